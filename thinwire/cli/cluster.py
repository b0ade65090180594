"""``thinwire cluster up|down|status|exec|bench|link|kill|restore SPEC``: the emulated cluster on this machine.

Thin wrappers over :mod:`thinwire.cluster.emulator` and :mod:`thinwire.cluster.bench`. Each command
function takes the parsed namespace and returns the process exit code; user mistakes surface as
:class:`~thinwire.errors.ThinwireError`. Everything but reading the spec needs root.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from thinwire.cli.common import COMMANDS
from thinwire.cluster.bench import bench, busy_latency, switch_bench
from thinwire.cluster.emulator import AGGREGATOR_GROUP, EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec, parse_size
from thinwire.errors import ThinwireError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``cluster`` and its subcommands; each sets ``func(args) -> int``."""
    p = subparsers.add_parser("cluster", help=COMMANDS["cluster"],
                              description="Emulate a cluster spec on this machine: a network namespace, "
                              "shaped links and a cgroup per host. Needs root.")
    sub = p.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")

    def command(name: str, func, help_: str) -> argparse.ArgumentParser:
        cp = sub.add_parser(name, help=help_)
        cp.add_argument("spec", help="cluster spec YAML (see examples/clusters/)")
        cp.set_defaults(func=func)
        return cp

    for name, func, help_ in (("up", cmd_up, "create the hosts, links and cgroups (idempotent)"),
                              ("down", cmd_down, "remove everything `up` created (idempotent)")):
        command(name, func, help_).add_argument(
            "--force", action="store_true", help="even while a job runs on the cluster (the job then fails; its "
            "checkpoints are kept)")
    command("status", cmd_status, "show hosts, addresses, rates and CPU quotas")
    ex = command("exec", cmd_exec, "run a command inside a host (its namespace and cgroups)")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command, after `--`")
    bn = command("bench", cmd_bench, "measure all-reduce bus bandwidth vs the configured rate")
    bn.add_argument("--hosts", help="comma-separated hosts to include (default: all)")
    bn.add_argument("--sizes", help="comma-separated message sizes such as 1MiB,4MiB (default: ~0.25-1 s each)")
    bn.add_argument("--reps", type=int, help="timed all-reduces per size (median is kept; default 5, 100 with --busy)")
    bn.add_argument("--busy", action="store_true",
                    help="instead: a 4-byte all-reduce's time with the hosts idle and while each computes (what a "
                         "CPU quota adds to a collective issued during backward)")
    bn.add_argument("--aggregation", choices=["ring", "switch"], default="ring",
                    help="switch: an int8 all-reduce of a gradient of --sizes (fp32 bytes) around the ring as "
                         "--compression int8 sends it and through the aggregator on the switch (spec `switch:`), "
                         "alternating rep by rep")
    bn.add_argument("--json", action="store_true", help="print the result as JSON")
    ln = command("link", cmd_link, "take a host's link down or up (fault tests)")
    ln.add_argument("host")
    ln.add_argument("state", choices=["up", "down"])
    kl = command("kill", cmd_kill, "a host dies: its link down, its processes killed (`restore` brings it back)")
    kl.add_argument("host")
    rs = command("restore", cmd_restore, "bring a killed host back; a `train --min-hosts` job starts on it again")
    rs.add_argument("host")
    return p


def _cluster(args: argparse.Namespace) -> EmulatedCluster:
    return EmulatedCluster(load_cluster_spec(args.spec))


def _refuse_if_running(cluster: EmulatedCluster, args: argparse.Namespace, doing: str) -> None:
    """A job on the cluster would lose its hosts under it: refused unless ``--force``."""
    busy = cluster.running()
    if busy and not args.force:
        which = "; ".join(f"{name}: pid {', '.join(map(str, pids[:3]))}{' ...' if len(pids) > 3 else ''}"
                          for name, pids in busy.items())
        raise ThinwireError(f"cluster: {cluster.spec.name} is running a job ({which}); {doing} would cut it off. Wait "
                            f"for it to finish or stop it (Ctrl-C in its terminal) first, or pass --force (the job "
                            f"fails; `thinwire train --resume OUT` goes on from its last checkpoint).")


def cmd_up(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    if not cluster.is_up():  # a rebuild of another version of the spec removes the one that is up
        _refuse_if_running(cluster, args, "rebuilding it")
    built = cluster.up()
    Console().print(f"cluster {cluster.spec.name!r} {'is up' if built else 'was already up'}: "
                    f"{len(cluster.spec.hosts)} hosts on {cluster.spec.subnet}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    _refuse_if_running(cluster, args, "taking it down")
    cluster.down()
    Console().print(f"cluster {cluster.spec.name!r} is down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    table = Table(title=f"cluster {cluster.spec.name} ({cluster.spec.subnet})")
    engines = any(h.nic is not None for h in cluster.spec.hosts)
    for col in ("host", "group", "address", "link", "out", "in", "cores", "memory") + (("engine cores",) if engines else ()):
        table.add_column(col)
    for s in cluster.status():
        table.add_row(s.name, s.group, s.address, "up" if s.link_up else "[red]down[/]", _rate(s.egress_bps),
                      _rate(s.ingress_bps), "-" if s.cpu is None else f"{s.cpu:g}",
                      "-" if s.memory is None else f"{s.memory / 2**20:g} MiB",
                      *((("-" if s.nic_cpu is None else f"{s.nic_cpu:g}"),) if engines else ()))
    console = Console()
    console.print(table)
    console.print(f"namespaces {cluster.switch_ns}.HOST; run a command with `thinwire cluster exec SPEC HOST -- CMD`")
    for link in cluster.spec.links:
        console.print(f"link {link.between[0]} <-> {link.between[1]}: {_rate(link.bandwidth)} each way, shared")
    if cluster.spec.switch is not None:
        agg = cluster.aggregator()
        cpu = cluster.cgroups.limits(AGGREGATOR_GROUP)[0]
        console.print(f"aggregator on the switch: {agg.address} on {agg.interface} in {agg.namespace}, "
                      f"{'no CPU cap' if cpu is None else f'{cpu:g} cores'} (`cluster bench --aggregation switch`)")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise ThinwireError("exec needs a command: `thinwire cluster exec SPEC HOST -- CMD [ARGS...]`.")
    cluster = _cluster(args)
    cluster.require_up(args.spec)
    proc = cluster.host(args.host).spawn(command)
    try:
        code = proc.wait()
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says it
    finally:  # stopped (Ctrl-C, SIGTERM, SIGHUP): leave nothing running inside the host
        if proc.poll() is None:
            proc.terminate()
            proc.wait()


def cmd_bench(args: argparse.Namespace) -> int:
    hosts = args.hosts.split(",") if args.hosts else None
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")] if args.sizes else None
    for size in sizes or []:  # a message of fp32 values: fewer than 4 bytes is none at all
        if size < 4:
            raise ThinwireError(f"--sizes: must be message sizes of at least 4 bytes (one fp32 value), got {size}; "
                                "e.g. --sizes 4KiB,1MiB (the default sizes last about 0.25-1 s each)")
    if args.reps is not None and args.reps < 1:
        raise ThinwireError(f"--reps: must be at least 1, got {args.reps}.")
    cluster = _cluster(args)
    if args.busy:
        return _bench_busy(cluster, hosts, args)
    args.reps = args.reps or 5
    if args.aggregation == "switch":
        return _bench_switch(cluster, hosts, sizes, args)
    result = bench(cluster, hosts=hosts, sizes=sizes, reps=args.reps)
    if args.json:
        print(json.dumps({**result.__dict__, "median_bps": result.median_bps, "ratio": result.ratio}))
        return 0
    table = Table(title=f"all-reduce bus bandwidth across {', '.join(result.hosts)} (gloo, median of {args.reps})")
    for col in ("size", "measured", "configured", "ratio"):
        table.add_column(col, justify="right")
    for n, bw in zip(result.sizes, result.busbw_bps):
        table.add_row(f"{n / 2**20:.2f} MiB", _rate(bw), _rate(result.expected_bps), f"{bw / result.expected_bps:.1%}")
    table.add_row("median", _rate(result.median_bps), _rate(result.expected_bps), f"{result.ratio:.1%}")
    Console().print(table)
    return 0


def _bench_switch(cluster, hosts, sizes, args) -> int:
    r = switch_bench(cluster, hosts=hosts, sizes=sizes, reps=args.reps)
    if args.json:
        print(json.dumps({**r.__dict__, "speedups": r.speedups}))
        return 0
    table = Table(title=f"int8 all-reduce across {', '.join(r.hosts)}: ring vs the switch's aggregator "
                        f"(gloo, median of {args.reps}, slowest host)")
    for col in ("gradient (fp32)", "ring", "switch", "switch speed-up"):
        table.add_column(col, justify="right")
    for n, a, b, x in zip(r.sizes, r.ring_s, r.switch_s, r.speedups):
        table.add_row(f"{n / 2**20:.2f} MiB", f"{a * 1e3:.1f} ms", f"{b * 1e3:.1f} ms", f"{x:.2f}x")
    Console().print(table)
    return 0


def _bench_busy(cluster, hosts, args) -> int:
    r = busy_latency(cluster, hosts=hosts, reps=args.reps or 100)
    if args.json:
        print(json.dumps({**r.__dict__, "hops": r.hops, "wait_per_hop_s": r.wait_per_hop_s}))
        return 0
    table = Table(title=f"a {r.size}-byte all-reduce across {', '.join(r.hosts)} (gloo, median of {args.reps or 100})")
    for col in ("hosts", "time", "per ring hop"):
        table.add_column(col, justify="right")
    table.add_row("idle", f"{r.idle_s * 1e3:.2f} ms", f"{r.idle_s / r.hops * 1e3:.2f} ms")
    table.add_row(f"computing ({r.load:.2f} cores on {r.hosts[0]})", f"{r.busy_s * 1e3:.2f} ms",
                  f"{r.busy_s / r.hops * 1e3:.2f} ms")
    Console().print(table)
    Console().print(f"a collective issued while the hosts compute waits {r.wait_per_hop_s * 1e3:.2f} ms more per ring hop")
    return 0


def cmd_link(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    cluster.set_link(args.host, args.state == "up")
    Console().print(f"{args.host}: link {args.state}")
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    _cluster(args).kill_host(args.host)
    Console().print(f"{args.host}: killed (link down, processes gone); `thinwire cluster restore` brings it back")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    _cluster(args).restore_host(args.host)
    Console().print(f"{args.host}: restored (link up)")
    return 0


def _rate(bps: float | None) -> str:
    if bps is None:
        return "unshaped"
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.4g} bit"
