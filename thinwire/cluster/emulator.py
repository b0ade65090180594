"""An emulated cluster on one Linux machine: a network namespace, an address and a cgroup per host.

Topology (all inside namespaces we create; the caller's namespace is never touched)::

    tw-<tag>.a1 [eth0 10.213.0.1] ==veth== p0 ┐
    tw-<tag>.a2 [eth0 10.213.0.2] ==veth== p1 ┴ bg0 ─ ug0 ==veth== cg0 ┐
    tw-<tag>.b1 [eth0 10.213.0.3] ==veth== p2 ─ bg1 ─ ug1 ==veth== cg1 ┴ br0     (namespace tw-<tag>)

* Each host's access link is the veth pair ``eth0``/``p<i>``: a tbf on ``eth0`` limits what the host
  sends, a tbf on the switch-side ``p<i>`` what it receives (qdiscs shape egress only).
* With one group, the ports hang on ``br0`` directly. With several, each group has a bridge ``bg<j>``
  and an uplink veth ``ug<j>``/``cg<j>`` to the core bridge ``br0``. The uplink's egress ``ug<j>``
  carries an htb with one class per linked group, classified by destination address, so all traffic
  from group j to group k shares one class at the link's rate: the inter-group rate is enforced on
  the aggregate, not per host pair. Groups with no link between them pass unshaped.
* The switch namespace holds only bridges (and, with ``switch:`` in the spec, the aggregator's address
  on ``br0``, the subnet's last usable one, with a cgroup of its own: :meth:`EmulatedCluster.aggregator`);
  hosts have no default route, so nothing leaves the namespaces. Interface names are per namespace, so they stay short whatever the host names.

CPU and memory limits come from :class:`~thinwire.cluster.cgroup.HostCgroups`. A small state file
``/run/thinwire/<tag>.json`` records what ``up`` built (the spec's fingerprint and cgroup folders),
so ``up`` twice is a no-op and ``down`` finds everything. ``/run`` is a tmpfs, like the namespaces.

Starting a process in a host (what ``thinwire train --cluster`` does)::

    cluster = EmulatedCluster(load_cluster_spec("examples/clusters/two-sites.yaml"))
    cluster.up()
    a1 = cluster.host("a1")                       # a1.address == "10.213.0.1"
    proc = a1.spawn([sys.executable, "-m", "torch.distributed.run", f"--master-addr={a1.address}", ...])
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from thinwire.cluster import netns
from thinwire.cluster.cgroup import HostCgroups, nic_group
from thinwire.cluster.spec import ClusterSpec, HostSpec, LinkSpec, spec_to_dict
from thinwire.errors import ThinwireError
from thinwire.signals import deferred

HOST_IF = "eth0"
NIC_ENV = "THINWIRE_NIC_CPU"  # set in a host with an offload engine (spec ``nic:``): the engine's cores
CORE_BRIDGE = "br0"
AGGREGATOR = "switch"          # the aggregator's name in logs and process titles (spec ``switch:``)
AGGREGATOR_GROUP = "switch.agg"  # its cgroup: a '.' no host name has
STATE_DIR = Path("/run/thinwire")
log = logging.getLogger(__name__)
LAYOUT_VERSION = 1  # bump when the topology built by `up` changes, so old clusters get rebuilt


def cluster_tag(name: str) -> str:
    """Short lowercase tag for namespace and cgroup names: ``Two_Sites`` -> ``two-sites``."""
    tag = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "cluster"
    if len(tag) > 24:
        tag = tag[:17] + "-" + hashlib.sha1(name.encode()).hexdigest()[:6]
    return tag


@dataclass(frozen=True)
class EmulatedHost:
    """One host of a running emulated cluster, and how to run a process in it.

    ``command(argv)`` wraps ``argv`` so it runs in the host's cgroups and network namespace;
    ``env()`` holds the variables that make gloo/NCCL/torchrun use the host's interface.
    """

    name: str
    namespace: str
    address: str
    interface: str
    cgroup_procs: tuple[str, ...] = field(default=())
    nic_cpu: float | None = None  # the host's offload engine (spec ``nic:``): its cores

    def command(self, argv: list[str]) -> list[str]:
        """``sh -c 'echo $$ > cgroup.procs...; exec ip netns exec NS "$@"' argv...``.

        The cgroups are joined *before* entering the namespace: ``ip netns exec`` remounts /sys, which
        hides /sys/fs/cgroup.
        """
        joins = "".join(f"echo $$ > {shlex.quote(f)} && " for f in self.cgroup_procs)
        ip = shutil.which("ip") or "ip"
        script = f'{joins}exec {ip} netns exec {shlex.quote(self.namespace)} "$@"'
        return ["sh", "-c", script, f"thinwire-{self.name}", *argv]

    def env(self) -> dict[str, str]:
        """Variables for processes in this host: bind gloo/NCCL to its interface, name it."""
        return {"GLOO_SOCKET_IFNAME": self.interface, "NCCL_SOCKET_IFNAME": self.interface,
                "TP_SOCKET_IFNAME": self.interface, "THINWIRE_HOST": self.name,
                "THINWIRE_HOST_ADDR": self.address, **({NIC_ENV: f"{self.nic_cpu:g}"} if self.nic_cpu else {})}

    def spawn(self, argv: list[str], *, env: dict[str, str] | None = None, **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside the host; ``env`` adds to the caller's environment and :meth:`env`."""
        full_env = {**os.environ, **self.env(), **(env or {})}
        return subprocess.Popen(self.command(argv), env=full_env, **popen_kwargs)


@dataclass(frozen=True)
class HostStatus:
    """One host as the kernel holds it now (rates in bit/s, cpu in cores, memory in bytes)."""

    name: str
    group: str
    namespace: str
    address: str
    link_up: bool
    egress_bps: float | None
    ingress_bps: float | None
    cpu: float | None
    memory: int | None
    nic_cpu: float | None = None  # the offload engine's cores (spec ``nic:``)


class EmulatedCluster:
    """Bring a :class:`ClusterSpec` up as namespaces, veths, bridges, tc shaping and cgroups."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.tag = cluster_tag(spec.name)
        self.switch_ns = f"tw-{self.tag}"
        self.cgroups = HostCgroups(self.tag)
        self.state_file = STATE_DIR / f"{self.tag}.json"
        blob = json.dumps([LAYOUT_VERSION, netns.QUEUE_SECONDS, spec_to_dict(spec)], sort_keys=True).encode()
        self.fingerprint = hashlib.sha1(blob).hexdigest()[:16]

    def namespace(self, host: str) -> str:
        return f"{self.switch_ns}.{self.spec.host(host).name}"

    def host(self, name: str) -> EmulatedHost:
        """The running host ``name``: its namespace, address, interface and cgroups."""
        return EmulatedHost(name=name, namespace=self.namespace(name), address=self.spec.address(name),
                            interface=HOST_IF, cgroup_procs=tuple(self.cgroups.procs_files(name)),
                            nic_cpu=self.spec.host(name).nic.cpu if self.spec.host(name).nic else None)

    def hosts(self) -> list[EmulatedHost]:
        return [self.host(n) for n in self.spec.host_names]

    def aggregator(self) -> EmulatedHost:
        """The switch's aggregator (spec ``switch:``): a process started with it runs in the switch's
        namespace on the core bridge, in the aggregator's cgroup."""
        if self.spec.switch is None:
            raise ThinwireError(f"cluster {self.spec.name!r} has no aggregator on its switch; add `switch: "
                                "{cpu: 0.5}` to the spec (and `thinwire cluster up` it again).")
        return EmulatedHost(name=AGGREGATOR, namespace=self.switch_ns, address=self.spec.switch_address,
                            interface=CORE_BRIDGE, cgroup_procs=tuple(self.cgroups.procs_files(AGGREGATOR_GROUP)))

    # ---- lifecycle ---------------------------------------------------------------------------------

    def is_up(self) -> bool:
        """True when this exact spec is up (state file fingerprint matches, all namespaces exist)."""
        state = self._state()
        wanted = {self.switch_ns, *(self.namespace(h) for h in self.spec.host_names)}
        return state.get("fingerprint") == self.fingerprint and wanted <= set(netns.list_namespaces())

    def up(self) -> bool:
        """Build the cluster; False if it was already up. A failure half-way removes everything."""
        netns.require_privileges()
        cores = os.cpu_count() or 1
        self.spec.check_fits(cores)
        # the hosts' own quotas, their offload engines' (nic:) and the switch's aggregator's: each its own cgroup
        wanted = (sum(h.cpu for h in self.spec.hosts if h.cpu is not None)
                  + sum(h.nic.cpu for h in self.spec.hosts if h.nic is not None and h.nic.cpu is not None)
                  + (self.spec.switch.cpu or 0.0 if self.spec.switch is not None else 0.0))
        if wanted > cores:
            log.warning("the hosts' cpu (with their engines and the switch's aggregator) adds up to %g cores on this "
                        "%d-core machine: busy hosts will slow each other beyond their quotas", wanted, cores)
        self._check_cgroup_support()
        if self.is_up():
            return False
        self.down()  # a stale or different cluster under the same tag
        try:
            self._build()
        except BaseException:  # an error, Ctrl-C, or SIGTERM/SIGHUP (see thinwire.signals)
            with deferred():  # a second signal must not cut the teardown short
                self.down()
            raise
        return True

    def down(self) -> None:
        """Remove our namespaces (and so their veths and bridges), cgroups and state. Idempotent."""
        netns.require_privileges()
        for ns in netns.list_namespaces():
            if ns == self.switch_ns or ns.startswith(self.switch_ns + "."):
                netns.delete_namespace(ns)
        self.cgroups.remove(self._state().get("cgroups", []))
        self.state_file.unlink(missing_ok=True)

    def set_link(self, host: str, up: bool) -> None:
        """Take ``host``'s access link down or up (its ``eth0``; the peer follows)."""
        self.require_up()
        netns.set_link_state(self.namespace(host), HOST_IF, up)

    def kill_host(self, host: str) -> None:
        """``host`` dies as a machine does: its link goes down and every process in it gets SIGKILL
        (no clean-up, no goodbye to its peers). :meth:`restore_host` brings it back."""
        self.require_up()
        self.spec.host(host)  # an unknown name is an error naming the hosts
        self.set_link(host, False)
        self._write_state(killed=sorted(self.killed_hosts() | {host}))
        for _ in range(50):  # until the host's groups are empty (a process may fork while we kill)
            pids = self.cgroups.pids(host)
            if not pids:
                break
            netns.kill_now(pids)
            time.sleep(0.02)

    def restore_host(self, host: str) -> None:
        """Bring a killed ``host`` back: its link up; a launcher that ran a job on it starts it there again."""
        self.require_up()
        self.spec.host(host)
        self.set_link(host, True)
        self._write_state(killed=sorted(self.killed_hosts() - {host}))

    def adopt_offloaded_threads(self, host: str) -> int:
        """Move ``host``'s communication threads (:data:`thinwire.compress.engine.OFFLOADED_THREADS`, by
        their OS names) onto its offload engine's cgroup (spec ``nic:``), as a smart NIC's processor runs
        them; what a launcher calls while a job runs, since a process inside the host cannot reach
        /sys/fs/cgroup (``ip netns exec`` remounts /sys). The number of threads moved now."""
        from thinwire.compress.engine import OFFLOADED_THREADS

        tasks = self.cgroups.nic_tasks_file(host)
        if tasks is None:
            return 0
        there = set(Path(tasks).read_text().split())
        moved = 0
        for pid in self.cgroups.pids(host):
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    if task.name in there or (task / "comm").read_text().strip() not in OFFLOADED_THREADS:
                        continue
                    Path(tasks).write_text(task.name)
                except OSError:  # the thread or process ended meanwhile
                    continue
                moved += 1
        return moved

    def oom_kills(self, host: str) -> int:
        """Processes of ``host`` killed by its memory limit since the cluster came up."""
        return self.cgroups.oom_kills(host)

    def killed_hosts(self) -> set[str]:
        return set(self._state().get("killed", []))

    def status(self) -> list[HostStatus]:
        """What the kernel holds now for each host: link state, tc rates, cgroup limits."""
        self.require_up()
        return [self._host_status(i, h) for i, h in enumerate(self.spec.hosts)]

    # ---- building ----------------------------------------------------------------------------------

    def _build(self) -> None:
        netns.add_namespace(self.switch_ns)
        self._check_netem()
        netns.add_bridge(self.switch_ns, CORE_BRIDGE)
        group_bridge = self._build_groups()
        for i, h in enumerate(self.spec.hosts):
            self._build_host(i, h, group_bridge[h.group])
        self._shape_group_links()
        if self.spec.switch is not None:
            netns.set_address(self.switch_ns, CORE_BRIDGE, f"{self.spec.switch_address}/{self.spec.prefixlen}")
            self.cgroups.create(AGGREGATOR_GROUP, self.spec.switch.cpu, None)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"fingerprint": self.fingerprint, "cgroups": [str(d) for d in self.cgroups.base_dirs()]}
        self.state_file.write_text(json.dumps(state))

    def _build_groups(self) -> dict[str, str]:
        """Group -> the bridge its hosts attach to (``br0`` itself when there is one group)."""
        groups = list(self.spec.groups)
        if len(groups) == 1:
            return {groups[0]: CORE_BRIDGE}
        out = {}
        for j, g in enumerate(groups):
            netns.add_bridge(self.switch_ns, f"bg{j}")
            netns.add_veth(self.switch_ns, f"ug{j}", self.switch_ns, f"cg{j}")
            netns.attach(self.switch_ns, f"ug{j}", f"bg{j}")
            netns.attach(self.switch_ns, f"cg{j}", CORE_BRIDGE)
            out[g] = f"bg{j}"
        return out

    def _build_host(self, i: int, h: HostSpec, bridge: str) -> None:
        ns, port = self.namespace(h.name), f"p{i}"
        netns.add_namespace(ns)
        netns.add_veth(ns, HOST_IF, self.switch_ns, port)
        netns.attach(self.switch_ns, port, bridge)
        netns.set_address(ns, HOST_IF, f"{self.spec.address(h.name)}/{self.spec.prefixlen}")
        netns.shape(ns, HOST_IF, h.bandwidth)
        netns.shape(self.switch_ns, port, h.bandwidth)
        self.cgroups.create(h.name, h.cpu, h.memory)
        if h.nic is not None:
            self.cgroups.create_nic(h.name, h.nic.cpu)

    def _shape_group_links(self) -> None:
        groups = self.spec.groups
        names = list(groups)
        for j, g in enumerate(names):
            classes = []
            for other in names:
                link = self.spec.link(g, other) if other != g else None
                if link is not None:
                    addresses = [self.spec.address(h) for h in groups[other]]
                    classes.append((link.bandwidth, addresses, _netem_args(link)))
            if classes:
                netns.shape_classes(self.switch_ns, f"ug{j}", classes)

    # ---- checks and state --------------------------------------------------------------------------

    def _check_cgroup_support(self) -> None:
        for i, h in enumerate(self.spec.hosts):
            if h.cpu is not None:
                self.cgroups.require("cpu", f"hosts[{i}].cpu")
            if h.memory is not None:
                self.cgroups.require("memory", f"hosts[{i}].memory")

    def _check_netem(self) -> None:
        wants = [(i, k) for i, l in enumerate(self.spec.links) for k in ("latency", "loss")
                 if getattr(l, k) is not None]
        if wants and not netns.has_netem(self.switch_ns):
            i, k = wants[0]
            raise ThinwireError(f"links[{i}].{k}: needs the netem qdisc, which this kernel lacks "
                                f"(only tbf/htb); remove the field")

    def require_up(self, spec_path: str = "SPEC") -> None:
        if not self.is_up():
            raise ThinwireError(self.not_up(spec_path))

    def not_up(self, spec_path: str = "SPEC") -> str:
        """Why this spec is not up: nothing of it is, or a cluster of its name is up from another version of it."""
        state = self._state()
        if state.get("fingerprint") not in (None, self.fingerprint) and self.switch_ns in netns.list_namespaces():
            return (f"cluster {self.spec.name!r} is up, but from another version of this spec (a host, link or limit "
                    f"differs); `thinwire cluster up {spec_path}` rebuilds it as this one.")
        return f"cluster {self.spec.name!r} is not up; start it with `thinwire cluster up {spec_path}`."

    def running(self) -> dict[str, list[int]]:
        """The processes in this cluster's cgroups now, by group (a host, its engine, the switch), whatever
        hosts the spec names today: what a rebuild or a teardown would cut off."""
        out: dict[str, set[int]] = {}
        for base in self.cgroups.base_dirs():
            for procs in base.rglob("cgroup.procs") if base.is_dir() else []:
                try:
                    pids = {int(p) for p in procs.read_text().split()}
                except OSError:  # removed meanwhile
                    continue
                if pids:
                    out.setdefault(str(procs.parent.relative_to(base)), set()).update(pids)
        return {name: sorted(pids) for name, pids in sorted(out.items())}

    def _state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def _write_state(self, **changes) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self._state(), **changes}))
        os.replace(tmp, self.state_file)

    def _host_status(self, i: int, h: HostSpec) -> HostStatus:
        ns = self.namespace(h.name)
        info = netns.link_info(ns, HOST_IF)
        egress = netns.qdisc_rates(ns, HOST_IF)
        ingress = netns.qdisc_rates(self.switch_ns, f"p{i}")
        cpu, mem = self.cgroups.limits(h.name)
        nic = self.cgroups.limits(nic_group(h.name))[0] if h.nic is not None else None
        return HostStatus(name=h.name, group=h.group, namespace=ns, address=self.spec.address(h.name),
                          link_up="UP" in info.get("flags", []), egress_bps=egress[0] if egress else None,
                          ingress_bps=ingress[0] if ingress else None, cpu=cpu, memory=mem, nic_cpu=nic)


def _netem_args(link: LinkSpec) -> list[str]:
    args = []
    if link.latency is not None:
        args += ["delay", f"{link.latency * 1e6:.0f}us"]
    if link.loss is not None:
        args += ["loss", f"{link.loss * 100:g}%"]
    return args
