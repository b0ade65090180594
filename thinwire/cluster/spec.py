"""The cluster spec: one YAML description of hosts and links, read by the emulator, simulator and planner.

A cluster is a list of hosts, each in a *group* (a site, a rack), each with an *access link* of its
own (``bandwidth``, both directions), a CPU allowance and an optional memory limit. Groups are joined
by *inter-group links*; traffic between two hosts goes through both access links and, when the hosts
sit in different groups joined by a link, through that link too. Groups with no link between them
are joined by an unshaped path (only the access links limit them).

Example (``examples/clusters/two-sites.yaml``)::

    name: two-sites
    subnet: 10.213.0.0/24          # private; exists only inside the emulator's namespaces
    defaults: {bandwidth: 100mbit, cpu: 1.0}
    hosts:
      - {name: a1, group: siteA}
      - {name: a2, group: siteA, cpu: 0.25}
      - {name: b1, group: siteB, bandwidth: 20mbit}
    links:
      - {between: [siteA, siteB], bandwidth: 50mbit}

Fields and units:

* ``name``: 1-24 lowercase letters, digits or '-' (default: the file's stem). It is the tag of the
  emulator's namespaces and cgroups as written, so no two names share a tag (``lab.v1`` and ``LAB_v1``
  would both be ``lab-v1``, and ``up`` of one would tear down the other).
* ``bandwidth``: bits per second. ``500kbit``, ``100mbit``, ``1gbit``, ``10gbit`` (decimal, as ``tc``
  writes them) or a plain number of bit/s. ``mbps``/``MB/s`` are refused: tc reads them as *bytes*.
* ``cpu``: how many cores the host may use, enforced by a cgroup CPU quota: ``0.25`` is a quarter of
  one core, ``2`` two cores; ``null`` (the default) means no cap. The ratio of two hosts' ``cpu`` is
  their relative compute speed, which is how the simulator and planner read it.
* ``memory``: bytes, ``512MiB``, ``2GiB``, ``1GB`` or a plain number; ``null`` means no limit.
* ``nic``: an offload engine with a processor of its own, ``{cpu: 0.25}`` (cores), as a smart NIC has:
  the host's communication work (the codec, error feedback, the collectives' copies and reductions)
  runs there, off the host's ``cpu``. The emulator gives the engine's threads a cgroup and quota of
  their own; ``null`` (the default) means none: communication shares the host's CPU.
* ``switch``: an aggregator on the switch, ``{cpu: 0.5}`` (cores; ``null``: no cap), for in-network
  aggregation (:mod:`thinwire.compress.switch`): the emulator gives it the switch's own namespace, the
  subnet's last usable address on the core bridge (its port, unshaped: each host's traffic to it is
  limited by the host's own link) and a cgroup of its own. ``null`` (the default): no aggregator.
* ``links[].latency`` (``5ms``) and ``links[].loss`` (``0.1%``): the simulator prices the latency (per hop of
  the collectives that cross the link), not the loss (a lossy link's TCP throughput falls below its bandwidth;
  ``simulate`` and ``plan`` say so); the emulator honours both only where the kernel has the ``netem`` qdisc.

After construction every value is resolved: ``host.bandwidth`` is a float in bit/s with the default
applied, ``host.memory`` an int of bytes or None, ``link.latency`` seconds, ``link.loss`` a fraction.

    >>> spec = ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth="100mbit"),
    ...                    hosts=[HostSpec(name="a"), HostSpec(name="b", bandwidth="20mbit")])
    >>> spec.bandwidth_bps("a", "b")
    20000000.0
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from thinwire.config import check, check_kind, from_dict, load_yaml
from thinwire.units import parse_duration, parse_loss, parse_rate, parse_size  # noqa: F401  (parse_size: cli)
from thinwire.errors import ConfigError, ThinwireError

DEFAULT_SUBNET = "10.213.0.0/24"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}", re.ASCII)
_NAME_RULE = "1-32 letters, digits, '-' or '_', starting with a letter or digit"
# the cluster's name is its tag in namespace and cgroup names (emulator.cluster_tag lowercases and maps
# '.' and '_' to '-'): only names the tag leaves unchanged are accepted, so two clusters never share one
_CLUSTER_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,22}[a-z0-9])?", re.ASCII)
_CLUSTER_NAME_RULE = "1-24 lowercase letters, digits or '-', starting and ending with a letter or digit"
MIN_CPU, MAX_CPU = 0.001, 4096.0  # a thousandth of a core; 1e-320 overflowed the simulator


@dataclass(kw_only=True)
class NicSpec:
    """A host's offload engine: ``cpu`` cores of its own for the communication work."""

    cpu: float

    def __post_init__(self) -> None:
        check(isinstance(self.cpu, (int, float)) and MIN_CPU <= self.cpu <= MAX_CPU, "cpu", self.cpu,
              f"a number of cores in [{MIN_CPU:g}, {MAX_CPU:g}] for the engine's own processor (0.25 = a quarter of one core)")


@dataclass(kw_only=True)
class SwitchSpec:
    """An aggregator on the switch: ``cpu`` cores of its own (None: no cap)."""

    cpu: float | None = None

    def __post_init__(self) -> None:
        check(self.cpu is None or (isinstance(self.cpu, (int, float)) and MIN_CPU <= self.cpu <= MAX_CPU),
              "cpu", self.cpu, f"a number of cores in [{MIN_CPU:g}, {MAX_CPU:g}] for the aggregator "
              "(0.5 = half of one core) or null for no cap")


@dataclass(kw_only=True)
class DefaultsSpec:
    """Values a host takes when it does not set them itself."""

    bandwidth: float | str | None = None
    cpu: float | None = None
    memory: int | str | None = None
    nic: NicSpec | None = None


@dataclass(kw_only=True)
class HostSpec:
    """One host: its access link (``bandwidth``, bit/s), CPU allowance (cores) and memory limit (bytes)."""

    name: str
    group: str = "default"
    bandwidth: float | str | None = None
    cpu: float | None = None
    memory: int | str | None = None
    nic: NicSpec | None = None

    def resolve(self, defaults: DefaultsSpec, where: str) -> None:
        """Apply ``defaults`` and parse units in place; errors name ``where`` (e.g. ``hosts[2]``)."""
        check(bool(_NAME.fullmatch(self.name)), f"{where}.name", self.name, _NAME_RULE,
              "Host names become namespace and cgroup names.")
        check(bool(_NAME.fullmatch(self.group)), f"{where}.group", self.group, _NAME_RULE)
        def field_of(name: str) -> str:  # a value taken from defaults is named there: that is where to fix it
            return f"{where}.{name}" if getattr(self, name) is not None or getattr(defaults, name) is None \
                else f"defaults.{name} (taken by {where})"

        bandwidth = self.bandwidth if self.bandwidth is not None else defaults.bandwidth
        check(bandwidth is not None, f"{where}.bandwidth", None, "a rate such as 100mbit",
              "Set it on the host or in defaults.bandwidth.")
        self.bandwidth = parse_rate(bandwidth, field_of("bandwidth"))
        cpu_field = field_of("cpu")
        self.cpu = self.cpu if self.cpu is not None else defaults.cpu
        check(self.cpu is None or MIN_CPU <= self.cpu <= MAX_CPU, cpu_field, self.cpu,
              f"a number of cores in [{MIN_CPU:g}, {MAX_CPU:g}] (0.25 = a quarter of one core) or null for no cap")
        memory_field = field_of("memory")
        memory = self.memory if self.memory is not None else defaults.memory
        self.memory = None if memory is None else parse_size(memory, memory_field)
        self.nic = self.nic if self.nic is not None else defaults.nic
        check(self.nic is None or self.cpu is None or self.nic.cpu <= self.cpu, f"{where}.nic.cpu",
              self.nic and self.nic.cpu, f"at most the host's own cpu ({_fmt_cores(self.cpu)})",
              "An offload engine is the smaller processor, as a smart NIC's is: lower nic.cpu or raise cpu.")


def _fmt_cores(cpu: float | None) -> str:
    return "no cap" if cpu is None else f"{cpu:g}"


@dataclass(kw_only=True)
class LinkSpec:
    """A link between two groups: every byte between them shares ``bandwidth`` (bit/s, each direction)."""

    between: list[str]
    bandwidth: float | str
    latency: float | str | None = None
    loss: float | str | None = None

    def resolve(self, groups: set[str], where: str) -> None:
        """Check the two groups and parse units in place."""
        check(len(self.between) == 2, f"{where}.between", self.between, "a list of exactly two group names")
        for i, g in enumerate(self.between):
            check(g in groups, f"{where}.between[{i}]", g, f"one of the groups ({', '.join(sorted(groups))})",
                  "Put a host in that group or fix the name.")
        check(self.between[0] != self.between[1], f"{where}.between", self.between, "two different groups",
              "Traffic inside a group is limited by the hosts' own bandwidth.")
        self.bandwidth = parse_rate(self.bandwidth, f"{where}.bandwidth")
        self.latency = None if self.latency is None else parse_duration(self.latency, f"{where}.latency")
        self.loss = None if self.loss is None else parse_loss(self.loss, f"{where}.loss")

    @property
    def pair(self) -> frozenset[str]:
        return frozenset(self.between)


@dataclass(kw_only=True)
class ClusterSpec:
    """A whole cluster; see the module docstring for the format. Build with :func:`load_cluster_spec`."""

    name: str
    subnet: str = DEFAULT_SUBNET
    defaults: DefaultsSpec = field(default_factory=DefaultsSpec)
    hosts: list[HostSpec]
    links: list[LinkSpec] = field(default_factory=list)
    switch: SwitchSpec | None = None

    def __post_init__(self) -> None:
        check(bool(_CLUSTER_NAME.fullmatch(self.name)), "name", self.name, _CLUSTER_NAME_RULE,
              "The name tags the emulator's namespaces and cgroups, so 'lab.v1' and 'LAB_v1' would both "
              "be 'lab-v1': write it as the tag (lab-v1), or set `name:` when the file's name is not one.")
        self._check_subnet()
        check(len(self.hosts) > 0, "hosts", self.hosts, "a non-empty list of hosts",
              "Add at least one entry such as {name: h1}.")
        seen: dict[str, int] = {}
        for i, h in enumerate(self.hosts):
            h.resolve(self.defaults, f"hosts[{i}]")
            check(h.name not in seen, f"hosts[{i}].name", h.name, "unique",
                  f"hosts[{seen.get(h.name)}] has the same name; rename one.")
            seen[h.name] = i
        usable = ipaddress.ip_network(self.subnet).num_addresses - 2 - (self.switch is not None)
        check(len(self.hosts) <= usable, "hosts", f"{len(self.hosts)} hosts",
              f"at most {usable} hosts for subnet {self.subnet}"
              + (" (its last address is the switch's aggregator)" if self.switch else ""),
              "Use a larger subnet such as a /16.")
        self._check_links()

    def _check_subnet(self) -> None:
        allowed = "a private IPv4 network such as 10.213.0.0/24 with room for the hosts"
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError:
            try:  # an address inside the network, not the network itself
                fix = f"Write the network's own address: {ipaddress.ip_network(self.subnet, strict=False)}."
            except ValueError:
                fix = "Write it as ADDRESS/PREFIX."
            raise ConfigError("subnet", self.subnet, allowed, fix) from None
        check(net.version == 4 and net.is_private and net.prefixlen <= 30, "subnet", self.subnet, allowed,
              "Pick a range from 10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16 that nothing else uses.")

    def _check_links(self) -> None:
        groups, first = set(self.groups), {}
        for i, link in enumerate(self.links):
            link.resolve(groups, f"links[{i}]")
            if link.pair in first:
                j = first[link.pair]
                same = self.links[j].bandwidth == link.bandwidth
                raise ConfigError(f"links[{i}]", sorted(link.pair), "one entry per pair of groups",
                                  f"{'It repeats' if same else 'It contradicts'} links[{j}]; keep one.")
            first[link.pair] = i

    @property
    def host_names(self) -> list[str]:
        return [h.name for h in self.hosts]

    @property
    def groups(self) -> dict[str, list[str]]:
        """Group name -> its hosts' names, both in the order of the spec."""
        out: dict[str, list[str]] = {}
        for h in self.hosts:
            out.setdefault(h.group, []).append(h.name)
        return out

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ThinwireError(f"cluster {self.name!r} has no host {name!r}; its hosts are {', '.join(self.host_names)}.")

    def index(self, name: str) -> int:
        """Position of host ``name`` in the spec (its address and rank order)."""
        return self.host_names.index(self.host(name).name)

    def address(self, name: str) -> str:
        """The host's IPv4 address: the subnet's (index+1)-th address."""
        return str(ipaddress.ip_network(self.subnet).network_address + self.index(name) + 1)

    @property
    def switch_address(self) -> str:
        """The aggregator's address on the switch (spec ``switch:``): the subnet's last usable one."""
        return str(ipaddress.ip_network(self.subnet).broadcast_address - 1)

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def link(self, group_a: str, group_b: str) -> LinkSpec | None:
        """The link between two different groups, or None (no link: an unshaped path)."""
        pair = frozenset((group_a, group_b))
        return next((l for l in self.links if l.pair == pair), None)

    def bandwidth_bps(self, a: str, b: str) -> float:
        """Bottleneck rate in bit/s from host ``a`` to host ``b``: the slower access link, and the
        inter-group link when they are in different groups joined by one. ``inf`` when ``a == b``."""
        if a == b:
            self.host(a)
            return float("inf")
        ha, hb = self.host(a), self.host(b)
        rates = [ha.bandwidth, hb.bandwidth]
        link = self.link(ha.group, hb.group) if ha.group != hb.group else None
        if link is not None:
            rates.append(link.bandwidth)
        return float(min(rates))

    def check_fits(self, cores: int) -> None:
        """Fail unless every host's ``cpu`` fits on a machine with ``cores`` cores (emulation needs it)."""
        for i, h in enumerate(self.hosts):
            check(h.cpu is None or h.cpu <= cores, f"hosts[{i}].cpu", h.cpu,
                  f"at most {cores} (the cores of this machine)", "Lower it or use null for no cap.")
            check(h.nic is None or h.nic.cpu <= cores, f"hosts[{i}].nic.cpu", h.nic and h.nic.cpu,
                  f"at most {cores} (the cores of this machine)", "Lower it.")
        check(self.switch is None or self.switch.cpu is None or self.switch.cpu <= cores, "switch.cpu",
              self.switch and self.switch.cpu, f"at most {cores} (the cores of this machine)", "Lower it.")


def load_cluster_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec YAML file; ``name`` defaults to the file's stem."""
    data = load_yaml(path, what="cluster spec")
    data.setdefault("name", Path(path).stem)
    check_kind(data, ClusterSpec, path, what="cluster spec",
               fix="Pass a cluster spec: a YAML file of hosts (and links), as in examples/clusters/.")
    return from_dict(ClusterSpec, data, where="")


def spec_to_dict(spec: ClusterSpec) -> dict:
    """Resolved plain data (rates in bit/s, sizes in bytes); loads back to an equal spec."""
    out = dataclasses.asdict(spec)
    out["defaults"] = {}
    return out


def unpriced_loss(spec: ClusterSpec) -> str | None:
    """A note for the model's users where a link of ``spec`` drops packets, which the model does not price."""
    lossy = [f"{'-'.join(sorted(link.pair))} ({link.loss:.2%})" for link in spec.links if link.loss]
    if not lossy:
        return None
    return (f"note: loss on link {', '.join(lossy)} is not priced: TCP's throughput on a lossy link falls below its "
            "bandwidth (about MSS / (RTT * sqrt(loss))), so the predicted times are optimistic there")
