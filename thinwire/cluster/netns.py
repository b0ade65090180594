"""Thin wrappers over ``ip`` and ``tc`` for the emulator: namespaces, veth pairs, bridges, shaping.

Every command names its namespace with ``ip -n NS`` / ``tc -n NS``, so nothing is ever created in, or
changed in, the caller's own (root) network namespace. Only the ``tbf`` and ``htb`` qdiscs are used
for rates; ``netem`` only where a link asks for latency or loss (and the kernel has it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

from thinwire.errors import ThinwireError

CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
QUEUE_SECONDS = 0.2  # tbf queue length in time at the link rate; at 50 ms TCP saw drops and 85% of the rate


def run(*argv: str, check: bool = True) -> str:
    """Run a command, return its stdout; a failure raises :class:`ThinwireError` quoting stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ThinwireError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def require_privileges() -> None:
    """Fail clearly unless ``ip``/``tc`` exist and we hold CAP_NET_ADMIN and CAP_SYS_ADMIN (root)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ThinwireError(f"the emulated cluster needs {' and '.join(missing)} (package iproute2); install it.")
    caps = 0
    with open("/proc/self/status") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    if not (caps >> CAP_NET_ADMIN & 1 and caps >> CAP_SYS_ADMIN & 1):
        raise ThinwireError("the emulated cluster needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create "
                            "network namespaces and cgroups; run it as root, e.g. `sudo thinwire cluster up SPEC`.")


def list_namespaces() -> list[str]:
    out = run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def add_namespace(ns: str) -> None:
    run("ip", "netns", "add", ns)
    run("ip", "-n", ns, "link", "set", "lo", "up")


def delete_namespace(ns: str) -> None:
    """Stop the processes inside ``ns`` (TERM, then KILL after 2 s), then delete it with its links."""
    kill_pids(int(p) for p in run("ip", "netns", "pids", ns, check=False).split())
    run("ip", "netns", "delete", ns, check=False)


def kill_pids(pids) -> None:
    """TERM the given processes (ones we started inside our namespaces/cgroups), KILL stragglers."""
    pids = [p for p in pids if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2.0
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def kill_now(pids) -> None:
    """SIGKILL the given processes (a machine that dies gives them no chance to clean up)."""
    for pid in [p for p in pids if p != os.getpid()]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone; its parent, maybe a Popen, reaps it and keeps its status)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def add_bridge(ns: str, name: str) -> None:
    run("ip", "-n", ns, "link", "add", name, "type", "bridge", "stp_state", "0")
    run("ip", "-n", ns, "link", "set", name, "up")


def add_veth(ns_a: str, name_a: str, ns_b: str, name_b: str) -> None:
    """A veth pair created directly inside its two namespaces (never in the caller's)."""
    run("ip", "link", "add", name_a, "netns", ns_a, "type", "veth", "peer", "name", name_b, "netns", ns_b)


def attach(ns: str, dev: str, bridge: str) -> None:
    run("ip", "-n", ns, "link", "set", dev, "master", bridge)
    run("ip", "-n", ns, "link", "set", dev, "up")


def set_address(ns: str, dev: str, cidr: str) -> None:
    run("ip", "-n", ns, "addr", "replace", cidr, "dev", dev)
    run("ip", "-n", ns, "link", "set", dev, "up")


def set_link_state(ns: str, dev: str, up: bool) -> None:
    run("ip", "-n", ns, "link", "set", dev, "up" if up else "down")


def link_info(ns: str, dev: str) -> dict:
    """``ip -j link show`` of one device (keys ``operstate``, ``flags``, ``ifalias``...)."""
    return json.loads(run("ip", "-j", "-n", ns, "link", "show", "dev", dev))[0]


def tbf_args(rate_bps: float) -> list[str]:
    """tbf parameters for ``rate_bps``: a bucket of 2 ms of traffic (>= 32 KiB so GSO packets pass).

    The bucket is not a real link's: after an idle gap up to 32 KiB leaves at once (at 100 Mbit/s a
    32 KiB message arrived in 0.2-0.5 ms, not 2.6). A smaller one was tried (2026-12-03): 0.25 ms of
    traffic below 262 Mbit/s, tbf then cutting GSO packets into frames. A lone message then took its
    time on the wire, but the 4-stage pipeline of ``benchmarks/pipeline.py`` at 100 Mbit/s went from
    290 to 440 ms per step (2 stages on 2 hosts at 0.9 core: 201 to 242 ms) while a 64 KiB exchange
    between two hosts took 5.7 ms (5.2 at the rate), idle or busy alike: forty times as many packets
    through the bridge and both tbfs, work a real switch and NIC do in hardware, took the emulated
    hosts' 2 cores. The 32 KiB bucket distorts less.
    """
    burst = max(32 * 1024, int(rate_bps / 8 * 0.002))
    return ["rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", f"{int(QUEUE_SECONDS * 1000)}ms"]


def shape(ns: str, dev: str, rate_bps: float) -> None:
    """Limit the traffic *leaving* ``dev`` to ``rate_bps`` with a token bucket (tbf)."""
    run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", *tbf_args(rate_bps))


def shape_classes(ns: str, dev: str, classes: list[tuple[float, list[str], list[str]]]) -> None:
    """htb on ``dev`` with one class per entry ``(rate_bps, dst_addresses, netem_args)``.

    Packets to an address of entry k go to class 1:(k+10) limited to its rate, shared by all of
    them; other packets (ARP, unlinked groups) are not classified and pass unshaped (htb default 0).
    ``netem_args`` (``["delay", "5ms"]``...) adds a netem leaf under the class when non-empty.
    """
    run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "0")
    for k, (rate, addresses, netem_args) in enumerate(classes):
        classid = f"1:{k + 10}"
        burst = str(max(32 * 1024, int(rate / 8 * 0.002)))
        run("tc", "-n", ns, "class", "replace", "dev", dev, "parent", "1:", "classid", classid, "htb",
            "rate", f"{int(rate)}bit", "ceil", f"{int(rate)}bit", "burst", burst, "cburst", burst,
            "quantum", "60000")
        if netem_args:
            run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "parent", classid, "netem", *netem_args)
        for addr in addresses:
            run("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "dst", f"{addr}/32", "flowid", classid)


def qdisc_rates(ns: str, dev: str) -> list[float]:
    """Configured rates (bit/s) on ``dev``: the tbf rate, or each htb class's rate."""
    text = run("tc", "-n", ns, "qdisc", "show", "dev", dev, check=False)
    text += run("tc", "-n", ns, "class", "show", "dev", dev, check=False)  # no JSON for htb classes
    units = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    return [float(n) * units[u.lower()] for n, u in re.findall(r"\brate ([0-9.]+)([KMGTkmgt]?)bit", text)]


def has_netem(ns: str) -> bool:
    """Whether this kernel offers the netem qdisc (probed on ``lo`` of our own namespace ``ns``)."""
    ok = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                        capture_output=True).returncode == 0
    if ok:
        run("tc", "-n", ns, "qdisc", "del", "dev", "lo", "root", check=False)
    return ok
