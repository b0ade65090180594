"""The cluster spec: parsing, units, the helpers the simulator and planner use, pinned error messages."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from thinwire.cluster.cgroup import Controller
from thinwire.cluster.emulator import EmulatedHost, cluster_tag
from thinwire.cluster.spec import (ClusterSpec, load_cluster_spec, parse_duration, parse_loss, parse_rate,
                                   parse_size, spec_to_dict)
from thinwire.config import from_dict
from thinwire.errors import ConfigError, ThinwireError

EXAMPLES = sorted((Path(__file__).parents[1] / "examples" / "clusters").glob("*.yaml"))


def make(hosts, links=(), **top) -> ClusterSpec:
    data = {"name": "t", "defaults": {"bandwidth": "100mbit"}, "hosts": list(hosts), "links": list(links), **top}
    return from_dict(ClusterSpec, data, where="")


def two_sites() -> ClusterSpec:
    return make([{"name": "a1", "group": "A"}, {"name": "a2", "group": "A", "cpu": 0.25},
                 {"name": "b1", "group": "B", "bandwidth": "20mbit", "memory": "512MiB"},
                 {"name": "b2", "group": "B"}, {"name": "c1", "group": "C"}],
                [{"between": ["A", "B"], "bandwidth": "50mbit", "latency": "5ms", "loss": "0.1%"}])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_parse(path):
    spec = load_cluster_spec(path)
    assert spec.host_names and all(h.bandwidth > 0 for h in spec.hosts)


def test_values_are_resolved_with_defaults_and_units():
    spec = two_sites()
    a2, b1 = spec.host("a2"), spec.host("b1")
    assert (a2.bandwidth, a2.cpu, a2.memory) == (100e6, 0.25, None)
    assert (b1.bandwidth, b1.memory) == (20e6, 512 * 2**20)
    assert (spec.links[0].bandwidth, spec.links[0].latency, spec.links[0].loss) == (50e6, 0.005, 0.001)
    assert spec.groups == {"A": ["a1", "a2"], "B": ["b1", "b2"], "C": ["c1"]}
    assert spec.host_names == ["a1", "a2", "b1", "b2", "c1"]


def test_bandwidth_is_the_bottleneck_of_access_and_group_links():
    spec = two_sites()
    assert spec.bandwidth_bps("a1", "a2") == 100e6   # same group: access links only
    assert spec.bandwidth_bps("a1", "b2") == 50e6    # the A-B link
    assert spec.bandwidth_bps("a1", "b1") == 20e6    # b1's own access link is slower still
    assert spec.bandwidth_bps("b1", "a1") == 20e6    # symmetric
    assert spec.bandwidth_bps("a1", "c1") == 100e6   # no A-C link: unshaped path between groups
    assert spec.bandwidth_bps("a1", "a1") == float("inf")


def test_addresses_come_from_the_subnet_in_host_order():
    spec = make([{"name": "x"}, {"name": "y"}], subnet="10.77.0.0/24")
    assert [spec.address(h) for h in spec.host_names] == ["10.77.0.1", "10.77.0.2"]
    assert make([{"name": "x"}]).address("x") == "10.213.0.1"


def test_load_defaults_name_to_file_stem_and_round_trips(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text("defaults: {bandwidth: 1gbit}\nhosts: [{name: h0}, {name: h1, cpu: 0.5}]\n")
    spec = load_cluster_spec(path)
    assert spec.name == "lab" and spec.host("h0").bandwidth == 1e9
    again = from_dict(ClusterSpec, spec_to_dict(spec), where="")
    assert spec_to_dict(again) == spec_to_dict(spec)


@pytest.mark.parametrize("text,bps", [("100mbit", 1e8), ("1gbit", 1e9), ("10Gbit", 1e10), ("500kbit", 5e5),
                                      (2_000_000, 2e6), ("2.5mbit", 2.5e6)])
def test_parse_rate(text, bps):
    assert parse_rate(text, "f") == bps


def test_parse_size_duration_loss():
    assert parse_size("512MiB", "f") == 512 * 2**20 and parse_size("2GiB", "f") == 2 * 2**30
    assert parse_size("1GB", "f") == 10**9 and parse_size(4096, "f") == 4096
    assert parse_duration("5ms", "f") == 0.005 and parse_duration("200us", "f") == pytest.approx(2e-4)
    assert parse_loss("0.1%", "f") == pytest.approx(0.001) and parse_loss(0.02, "f") == 0.02


@pytest.mark.parametrize("hosts,links,match", [
    ([], [], r"^hosts: must be a non-empty list of hosts, got \[\]"),
    ([{"name": "a"}, {"name": "a"}], [], r"^hosts\[1\]\.name: must be unique, got 'a'\. hosts\[0\] has the same name"),
    ([{"name": "a", "cpu": 0}], [], r"^hosts\[0\]\.cpu: must be a number of cores in \[0.001, 4096\]"),
    ([{"name": "a", "cpu": -1.5}], [], r"^hosts\[0\]\.cpu: must be a number of cores in \[0.001, 4096\] .*got -1\.5"),
    ([{"name": "a", "bandwidth": "0mbit"}], [], r"^hosts\[0\]\.bandwidth: must be a rate > 0 .*got '0mbit'"),
    ([{"name": "a", "bandwidth": -5}], [], r"^hosts\[0\]\.bandwidth: must be a rate > 0"),
    ([{"name": "a", "bandwidth": "100mbps"}], [], r"^hosts\[0\]\.bandwidth: .*got '100mbps'\. tc reads 'mbps' as megabytes per "
     r"second; write 800mbit for 100 MB/s \(100mbit for 100 Mbit/s\)"),
    ([{"name": "a", "bandwidth": "1gbps"}], [], r"got '1gbps'\. tc reads 'gbps' as gigabytes per second; write 8gbit for 1 GB/s"),
    ([{"name": "a", "bandwidth": "100 Mbit/s"}], [], r"got '100 Mbit/s'\. Write 100mbit for 100 Mbit/s\.$"),
    ([{"name": "a", "bandwidth": "12.5MB/s"}], [], r"got '12.5MB/s'\. Write 100mbit for 12.5 MB/s\.$"),
    ([{"name": "a", "bandwidth": "fast"}], [], r"^hosts\[0\]\.bandwidth: .*got 'fast'\. Use the units bit, kbit, mbit"),
    ([{"name": "a", "memory": "2 parsecs"}], [], r"^hosts\[0\]\.memory: must be a size > 0 .*Use the units KiB"),
    ([{"name": "a b"}], [], r"^hosts\[0\]\.name: must be 1-32 letters, digits"),
    ([{"name": "a", "speed": 2}], [], r"^hosts\[0\]\.speed: must be one of the known fields"),
    ([{"name": "a", "cpu": "lots"}], [], r"^hosts\[0\]\.cpu: must be a finite number or null, got 'lots'"),
    ([{"name": "a", "nic": {"cpu": 0}}], [], r"^hosts\[0\]\.nic\.cpu: must be a number of cores in \[0.001, 4096\] for the engine"),
    ([{"name": "a", "nic": {"cores": 1}}], [], r"^hosts\[0\]\.nic\.cores: must be one of the known fields \(cpu\)"),
    ([{"name": "a", "nic": 0.25}], [], r"^hosts\[0\]\.nic: must be a mapping of field: value, got 0.25"),
    ([{"name": "a", "cpu": 0.25, "nic": {"cpu": 0.5}}], [],
     r"^hosts\[0\]\.nic\.cpu: must be at most the host's own cpu \(0.25\), got 0.5\. An offload engine is the smaller"),
    ([{"name": "a", "group": "A"}, {"name": "b", "group": "B"}], [{"between": ["A", "Z"], "bandwidth": "1mbit"}],
     r"^links\[0\]\.between\[1\]: must be one of the groups \(A, B\), got 'Z'"),
    ([{"name": "a", "group": "A"}], [{"between": ["A", "A"], "bandwidth": "1mbit"}],
     r"^links\[0\]\.between: must be two different groups, got \['A', 'A'\]"),
    ([{"name": "a", "group": "A"}, {"name": "b", "group": "B"}], [{"between": ["A"], "bandwidth": "1mbit"}],
     r"^links\[0\]\.between: must be a list of exactly two group names"),
    ([{"name": "a", "group": "A"}, {"name": "b", "group": "B"}],
     [{"between": ["A", "B"], "bandwidth": "10mbit"}, {"between": ["B", "A"], "bandwidth": "20mbit"}],
     r"^links\[1\]: must be one entry per pair of groups, got \['A', 'B'\]\. It contradicts links\[0\]"),
    ([{"name": "a", "group": "A"}, {"name": "b", "group": "B"}],
     [{"between": ["A", "B"], "bandwidth": "10mbit"}, {"between": ["A", "B"], "bandwidth": 1e7}],
     r"^links\[1\]: must be one entry per pair of groups.*It repeats links\[0\]"),
    ([{"name": "a", "group": "A"}, {"name": "b", "group": "B"}],
     [{"between": ["A", "B"], "bandwidth": "10mbit", "latency": "soon"}], r"^links\[0\]\.latency: must be a duration"),
    ([{"name": "a", "group": "A"}, {"name": "b", "group": "B"}],
     [{"between": ["A", "B"], "bandwidth": "10mbit", "loss": "150%"}], r"^links\[0\]\.loss: must be a loss rate in \[0, 1\)"),
])
def test_bad_specs_fail_naming_field_value_and_fix(hosts, links, match):
    with pytest.raises(ConfigError, match=match):
        make(hosts, links)


def test_bandwidth_must_be_given_somewhere():
    with pytest.raises(ConfigError, match=r"^hosts\[0\]\.bandwidth: .*Set it on the host or in defaults\.bandwidth"):
        from_dict(ClusterSpec, {"name": "t", "hosts": [{"name": "a"}]}, where="")


@pytest.mark.parametrize("subnet,match", [("8.8.8.0/24", "Pick a range from 10.0.0.0/8"),
                                          ("10.0.0.0/33", "Write it as ADDRESS/PREFIX"),
                                          ("10.0.0.0/31", "subnet: must be a private IPv4 network"),
                                          ("10.250.3.5/24", r"Write the network's own address: 10.250.3.0/24\.$")])
def test_subnet_must_be_private_ipv4(subnet, match):
    with pytest.raises(ConfigError, match=match):
        make([{"name": "a"}], subnet=subnet)


def test_subnet_must_hold_the_hosts():
    with pytest.raises(ConfigError, match=r"^hosts: must be at most 2 hosts for subnet 10.1.0.0/30"):
        make([{"name": f"h{i}"} for i in range(3)], subnet="10.1.0.0/30")


def test_an_offload_engine_is_a_host_field_with_a_default():
    spec = make([{"name": "a"}, {"name": "b", "nic": {"cpu": 0.5}}, {"name": "c"}], defaults={"bandwidth": "1gbit", "nic": {"cpu": 0.25}})
    assert [h.nic.cpu for h in spec.hosts] == [0.25, 0.5, 0.25]
    assert make([{"name": "a"}]).hosts[0].nic is None
    env = EmulatedHost(name="a", namespace="ns", address="10.0.0.1", interface="eth0", nic_cpu=0.25).env()
    assert env["THINWIRE_NIC_CPU"] == "0.25"
    assert "THINWIRE_NIC_CPU" not in EmulatedHost(name="a", namespace="ns", address="10.0.0.1", interface="eth0").env()
    with pytest.raises(ConfigError, match=r"^hosts\[1\]\.nic\.cpu: must be at most 2 \(the cores of this machine\), got 3"):
        make([{"name": "a"}, {"name": "b", "nic": {"cpu": 3}}]).check_fits(cores=2)


def test_a_switch_aggregator_takes_the_subnets_last_address_and_its_own_cpu():
    spec = make([{"name": "a"}, {"name": "b"}], switch={"cpu": 0.5})
    assert spec.switch.cpu == 0.5 and spec.switch_address == "10.213.0.254"
    assert make([{"name": "a"}]).switch is None
    assert make([{"name": "a"}], switch={}).switch.cpu is None  # no cap
    with pytest.raises(ConfigError, match=r"^switch\.cpu: must be a number of cores .* got -1"):
        make([{"name": "a"}], switch={"cpu": -1})
    with pytest.raises(ConfigError, match=r"^switch\.cpu: must be at most 2 \(the cores of this machine\), got 3"):
        make([{"name": "a"}], switch={"cpu": 3}).check_fits(cores=2)
    with pytest.raises(ConfigError, match=r"^hosts: must be at most 1 hosts for subnet 10.1.0.0/30 \(its last address is the switch's aggregator\)"):
        make([{"name": "a"}, {"name": "b"}], subnet="10.1.0.0/30", switch={"cpu": 0.5})
    with pytest.raises(ConfigError, match=r"^switch\.nic: must be one of the known fields \(cpu\)"):
        make([{"name": "a"}], switch={"nic": 1})


def test_cpu_must_fit_this_machine():
    spec = make([{"name": "a", "cpu": 1.0}, {"name": "b", "cpu": 3.0}])
    spec.check_fits(cores=4)
    with pytest.raises(ConfigError, match=r"^hosts\[1\]\.cpu: must be at most 2 \(the cores of this machine\), got 3\.0"):
        spec.check_fits(cores=2)


def test_unknown_host_lists_the_known_ones():
    with pytest.raises(ThinwireError, match="cluster 't' has no host 'zz'; its hosts are a1, a2, b1, b2, c1"):
        two_sites().bandwidth_bps("a1", "zz")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ThinwireError, match="cluster spec .*nope.yaml' does not exist"):
        load_cluster_spec(tmp_path / "nope.yaml")


# ---- pure parts of the emulator (no root needed) ------------------------------------------------------


def test_cluster_tag_is_short_and_safe():
    assert cluster_tag("Two_Sites") == "two-sites"
    long = cluster_tag("a-very-long-cluster-name-for-a-lab-in-the-basement")
    assert len(long) <= 24 and long != cluster_tag("a-very-long-cluster-name-for-a-lab-in-the-attic")


def test_host_command_joins_cgroups_before_the_namespace():
    host = EmulatedHost(name="a1", namespace="tw-t.a1", address="10.213.0.1", interface="eth0",
                        cgroup_procs=("/sys/fs/cgroup/cpu/tw-t/a1/cgroup.procs",))
    argv = host.command(["python", "-c", "print(1)"])
    assert argv[:2] == ["sh", "-c"] and argv[-3:] == ["python", "-c", "print(1)"]
    script = argv[2]
    assert script.index("cgroup.procs") < script.index("netns exec tw-t.a1")
    assert host.env()["GLOO_SOCKET_IFNAME"] == "eth0" and host.env()["THINWIRE_HOST_ADDR"] == "10.213.0.1"


def test_cgroup_limit_files():
    v1cpu, v2cpu = Controller("cpu", 1, Path("/x")), Controller("cpu", 2, Path("/x"))
    assert v1cpu.limit_files(0.25, None) == {"cpu.cfs_period_us": "10000", "cpu.cfs_quota_us": "2500"}
    assert v1cpu.limit_files(0.05, None) == {"cpu.cfs_period_us": "20000", "cpu.cfs_quota_us": "1000"}  # 1 ms floor
    assert v1cpu.limit_files(None, None)["cpu.cfs_quota_us"] == "-1"
    assert v2cpu.limit_files(1.5, None) == {"cpu.max": "15000 10000"}
    assert v2cpu.limit_files(None, None) == {"cpu.max": "max 10000"}
    assert v2cpu.limit_files(1e-4, None) == {"cpu.max": "1000 1000000"}  # the longest period; the kernel's floor
    assert Controller("memory", 1, Path("/x")).limit_files(None, 2**30) == {"memory.limit_in_bytes": str(2**30)}
    assert Controller("memory", 2, Path("/x")).limit_files(None, None) == {"memory.max": "max"}


def test_cli_parses_every_subcommand():
    from thinwire.cli.cluster import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cluster", "exec", "s.yaml", "a1", "--", "python", "-V"])
    assert (args.spec, args.host, args.argv[-2:], args.command) == ("s.yaml", "a1", ["python", "-V"], "cluster")
    args = parser.parse_args(["cluster", "link", "s.yaml", "a1", "down"])
    assert (args.host, args.state, args.func.__name__) == ("a1", "down", "cmd_link")
    args = parser.parse_args(["cluster", "bench", "s.yaml", "--sizes", "1MiB,4MiB", "--reps", "3"])
    assert (args.sizes, args.reps, args.func.__name__) == ("1MiB,4MiB", 3, "cmd_bench")


def test_cgroup_v2_controller_thinwire_enabled_is_turned_off_with_the_last_cluster(tmp_path, monkeypatch):
    """A fake cgroup v2 root: ``+cpu`` written by thinwire is reverted once no ``tw-*`` group remains."""
    from thinwire.cluster import cgroup

    monkeypatch.setattr(cgroup, "ENABLED_FILE", tmp_path / "run" / "cgroup-enabled.json")
    root, other = tmp_path / "root", tmp_path / "other"
    for d, on in ((root, ""), (other, "cpu memory")):
        d.mkdir()
        (d / "cgroup.subtree_control").write_text(on)
    for d in (root, other):
        if cgroup._enable(d, "cpu"):
            cgroup._remember(d, "cpu")
    assert (root / "cgroup.subtree_control").read_text() == "+cpu"  # turned on by us
    assert (other / "cgroup.subtree_control").read_text() == "cpu memory"  # already on: not ours
    (root / "tw-a").mkdir()
    cgroup.revert_enabled()  # a cluster still runs under root: keep it on
    assert (root / "cgroup.subtree_control").read_text() == "+cpu"
    (root / "tw-a").rmdir()
    cgroup.revert_enabled()
    assert (root / "cgroup.subtree_control").read_text() == "-cpu"
    assert (other / "cgroup.subtree_control").read_text() == "cpu memory"
    assert not cgroup.ENABLED_FILE.exists()


@pytest.mark.parametrize("defaults,match", [
    ({"bandwidth": "10qbit"}, r"^defaults\.bandwidth \(taken by hosts\[0\]\): must be a rate > 0 .*got '10qbit'"),
    ({"bandwidth": "1gbit", "cpu": -1}, r"^defaults\.cpu \(taken by hosts\[0\]\): must be a number of cores"),
    ({"bandwidth": "1gbit", "memory": "3 parsecs"}, r"^defaults\.memory \(taken by hosts\[0\]\): must be a size > 0"),
])
def test_a_bad_default_is_named_where_it_is_set_not_only_as_the_first_hosts(defaults, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(ClusterSpec, {"name": "t", "defaults": defaults, "hosts": [{"name": "a"}, {"name": "b"}]}, where="")


def test_another_kind_of_file_given_as_a_cluster_spec_is_named_as_such(tmp_path):
    """A profile or a plan passed as --cluster said "achieved_flops: must be one of the known fields ... Remove or
    rename the key", naming neither the file nor the mistake."""
    from thinwire.errors import ThinwireError

    profile = tmp_path / "prof.yaml"
    profile.write_text("version: 1\nworkload: charlm\nachieved_flops: 1.0e9\nbuckets: []\ncompute: []\n")
    with pytest.raises(ThinwireError, match=r"cluster spec: '.*prof\.yaml' is not a cluster spec: it lacks hosts and "
                                            r"holds achieved_flops, buckets, compute, version, keys no cluster spec has\. "
                                            r"Pass a cluster spec"):
        load_cluster_spec(profile)
    typo = tmp_path / "typo.yaml"  # a spec with a misspelt key is still told the key
    typo.write_text("hosts:\n  - {name: a}\n  - {name: b}\nlinkz: []\n")
    with pytest.raises(ConfigError, match=r"linkz: must be one of the known fields"):
        load_cluster_spec(typo)


def test_a_lossy_link_is_said_to_be_unpriced(tmp_path):
    """The spec's docs said the simulator reads a link's loss; it prices only the latency, and now says so."""
    from thinwire.cluster.spec import load_cluster_spec, unpriced_loss

    path = tmp_path / "lossy.yaml"
    path.write_text("name: lossy\ndefaults: {bandwidth: 1gbit}\nhosts:\n  - {name: a, group: x}\n  - {name: b, group: y}\n"
                    "links:\n  - {between: [x, y], bandwidth: 50mbit, latency: 5ms, loss: 0.1%}\n")
    assert unpriced_loss(load_cluster_spec(path)).startswith("note: loss on link x-y (0.10%) is not priced")
    path.write_text(path.read_text().replace(", loss: 0.1%", ""))
    assert unpriced_loss(load_cluster_spec(path)) is None
