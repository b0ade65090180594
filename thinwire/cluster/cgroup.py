"""Per-host cgroups for the emulator: a CPU quota (in cores) and an optional memory limit.

Layout: ``<parent>/tw-<tag>/<host>`` in each controller used. With cgroup v1 (separate ``cpu`` and
``memory`` hierarchies) ``<parent>`` is the caller's own cgroup in that hierarchy, so limits the
machine already puts on the caller keep applying. With cgroup v2 it is the hierarchy's root, because
v2 forbids enabling controllers below a cgroup that holds processes.

A host's processes join by writing their pid to each ``cgroup.procs`` file of :meth:`procs_files`;
children inherit the group. CPU: ``cpu.cfs_quota_us / cpu.cfs_period_us`` (v1) or ``cpu.max`` (v2)
set to ``cpu`` cores, so ``cpu: 0.25`` runs a host at a quarter of one core
(https://docs.kernel.org/scheduler/sched-bwc.html). The period is short (10 ms, longer only where
the kernel's 1 ms minimum quota needs it): a host may use its quota in one burst at the start of
each period, so with the kernel's default 100 ms period a quarter-core host that idles while it
waits for the network runs the next 25 ms of work at full speed. Measured here, 48 ms of CPU work
separated by 60 ms idle gaps took 138 ms per burst at a 100 ms period and 185 ms at 10 ms, where a
quarter of a core takes 192 ms (``benchmarks/cpu_quota.py``). Memory: ``memory.limit_in_bytes`` / ``memory.max``.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from thinwire.cluster.netns import kill_pids
from thinwire.errors import ThinwireError

# controllers thinwire turned on in a v2 parent's cgroup.subtree_control, to turn off again when the
# last thinwire cluster under that parent goes (shared by all clusters, like the parent itself)
ENABLED_FILE = Path("/run/thinwire/cgroup-enabled.json")
log = logging.getLogger(__name__)
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel refuses smaller quotas
MAX_PERIOD_US = 1_000_000  # and longer periods


def cpu_quota(cpu: float) -> tuple[int, int]:
    """``(quota_us, period_us)`` that run a group at ``cpu`` cores, with the shortest period allowed."""
    period = min(MAX_PERIOD_US, max(PERIOD_US, math.ceil(MIN_QUOTA_US / cpu)))
    return max(MIN_QUOTA_US, round(cpu * period)), period


@dataclass(frozen=True)
class Controller:
    """Where one controller (``cpu`` or ``memory``) is mounted, and under which cgroup we nest."""

    name: str
    version: int
    parent: Path

    def limit_files(self, cpu: float | None, memory: int | None) -> dict[str, str]:
        """File name -> value that sets the limit (no limit when the value is None)."""
        if self.name == "cpu" and self.version == 1:
            quota, period = (-1, PERIOD_US) if cpu is None else cpu_quota(cpu)
            return {"cpu.cfs_period_us": str(period), "cpu.cfs_quota_us": str(quota)}
        if self.name == "cpu":
            quota, period = ("max", PERIOD_US) if cpu is None else cpu_quota(cpu)
            return {"cpu.max": f"{quota} {period}"}
        key = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        return {key: "-1" if memory is None and self.version == 1 else str(memory or "max")}


def _mounts() -> list[tuple[str, str, set[str]]]:
    with open("/proc/self/mounts") as f:
        rows = [line.split() for line in f]
    return [(r[1], r[2], set(r[3].split(","))) for r in rows if r[2] in ("cgroup", "cgroup2")]


def _own_paths() -> dict[str, str]:
    """Controller name (``""`` for v2) -> the caller's cgroup path, from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                out[name] = path
    return out


def find_controller(name: str) -> Controller | None:
    """The writable ``cpu`` or ``memory`` controller of this machine, v1 preferred, or None."""
    own = _own_paths()
    for mount, fstype, opts in _mounts():
        if fstype == "cgroup" and name in opts and name in own:
            return Controller(name, 1, Path(mount) / own[name].lstrip("/"))
    for mount, fstype, _ in _mounts():
        controllers = Path(mount, "cgroup.controllers")
        if fstype == "cgroup2" and controllers.exists() and name in controllers.read_text().split():
            return Controller(name, 2, Path(mount))
    return None


class HostCgroups:
    """The cgroups of one emulated cluster (tag ``tag``), one per host and controller."""

    def __init__(self, tag: str) -> None:
        self.dirname = f"tw-{tag}"
        self.controllers = {n: c for n in ("cpu", "memory") if (c := find_controller(n)) is not None}

    def base_dirs(self) -> list[Path]:
        return [c.parent / self.dirname for c in self.controllers.values()]

    def require(self, name: str, field: str) -> None:
        if name not in self.controllers:
            raise ThinwireError(f"{field}: needs the {name} cgroup controller, which this machine does not "
                                f"offer (none mounted, or not writable); remove the field.")

    def create(self, host: str, cpu: float | None, memory: int | None) -> None:
        """Create ``host``'s groups (cpu always when available, memory only with a limit) and set limits."""
        for c in self.controllers.values():
            if c.name == "memory" and memory is None:
                continue
            base = c.parent / self.dirname
            base.mkdir(exist_ok=True)
            if c.version == 2:
                if _enable(c.parent, c.name):
                    _remember(c.parent, c.name)
                _enable(base, c.name)
            (base / host).mkdir(exist_ok=True)
            for fname, value in c.limit_files(cpu, memory).items():
                (base / host / fname).write_text(value)

    def create_nic(self, host: str, cpu: float) -> None:
        """The cgroup of ``host``'s offload engine (spec ``nic:``): a sibling of the host's own, with its
        own quota, that the host's communication threads move into (thread by thread: cgroup v1's
        ``tasks`` file; v2 would need threaded cgroups, not built)."""
        c = self.controllers.get("cpu")
        if c is None or c.version != 1:
            raise ThinwireError("nic: an offload engine needs the cgroup v1 cpu controller, to move single "
                                f"threads into a group of their own ({'cgroup v2 here' if c else 'no cpu controller here'}); "
                                "remove `nic:` from the cluster spec.")
        d = c.parent / self.dirname / nic_group(host)
        d.mkdir(exist_ok=True)
        for fname, value in c.limit_files(cpu, None).items():
            (d / fname).write_text(value)

    def nic_tasks_file(self, host: str) -> str | None:
        """The file a thread of ``host`` writes its id into to run on the host's offload engine; None without one."""
        c = self.controllers.get("cpu")
        f = c.parent / self.dirname / nic_group(host) / "tasks" if c is not None else None
        return str(f) if f is not None and f.exists() else None

    def procs_files(self, host: str) -> list[str]:
        """The ``cgroup.procs`` files a process of ``host`` writes its pid into (existing ones only)."""
        files = [c.parent / self.dirname / host / "cgroup.procs" for c in self.controllers.values()]
        return [str(f) for f in files if f.exists()]

    def pids(self, host: str) -> list[int]:
        """The processes in ``host``'s groups now."""
        out: set[int] = set()
        for f in self.procs_files(host):
            out |= {int(p) for p in Path(f).read_text().split()}
        return sorted(out)

    def limits(self, host: str) -> tuple[float | None, int | None]:
        """The (cores, memory bytes) the kernel holds for ``host`` now; None = no limit or no group."""
        cpu = mem = None
        for c in self.controllers.values():
            d = c.parent / self.dirname / host
            if not d.exists():
                continue
            if c.name == "cpu":
                quota, period = _read_cpu(d, c.version)
                cpu = None if quota < 0 else quota / period
            else:
                raw = (d / ("memory.limit_in_bytes" if c.version == 1 else "memory.max")).read_text().strip()
                mem = None if raw == "max" or int(raw) >= 2**62 else int(raw)
        return cpu, mem

    def oom_kills(self, host: str) -> int:
        """How many processes ``host``'s memory limit has killed (v2 ``memory.events``, v1 ``memory.oom_control``)."""
        c = self.controllers.get("memory")
        d = c.parent / self.dirname / host if c else None
        f = d / ("memory.events" if c.version == 2 else "memory.oom_control") if d else None
        if f is None or not f.is_file():
            return 0
        for line in f.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def remove(self, extra: list[str] = ()) -> None:
        """Kill the processes left in our groups, then remove the groups; missing ones are fine."""
        for base in {*self.base_dirs(), *map(Path, extra)}:
            if not base.is_dir() or base.name != self.dirname:
                continue
            for host_dir in [d for d in base.iterdir() if d.is_dir()]:
                kill_pids(int(p) for p in (host_dir / "cgroup.procs").read_text().split())
                _rmdir(host_dir)
            _rmdir(base)
        revert_enabled()


def nic_group(host: str) -> str:
    """The cgroup name of ``host``'s offload engine (a '.' no host name has, so never a host's)."""
    return f"{host}.nic"


def _read_cpu(d: Path, version: int) -> tuple[int, int]:
    if version == 1:
        return int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text())
    quota, period = (d / "cpu.max").read_text().split()
    return (-1 if quota == "max" else int(quota)), int(period)


def _enable(d: Path, name: str) -> bool:
    """Turn controller ``name`` on for ``d``'s children; True if this call turned it on."""
    control = d / "cgroup.subtree_control"
    if name in control.read_text().split():
        return False
    control.write_text(f"+{name}")
    return True


def _enabled_records() -> list[list[str]]:
    try:
        return json.loads(ENABLED_FILE.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _remember(parent: Path, name: str) -> None:
    records = _enabled_records()
    if [str(parent), name] not in records:
        ENABLED_FILE.parent.mkdir(parents=True, exist_ok=True)
        ENABLED_FILE.write_text(json.dumps(records + [[str(parent), name]]))


def revert_enabled() -> None:
    """Turn off the controllers thinwire turned on, under parents that hold no thinwire cluster now.

    A controller still in use below the parent (by something else since) makes the kernel refuse
    (EBUSY); then it stays on, with a warning, and the record is kept for the next ``down``."""
    keep = []
    for parent, name in _enabled_records():
        if any(Path(parent).glob("tw-*")):
            keep.append([parent, name])
            continue
        try:
            (Path(parent) / "cgroup.subtree_control").write_text(f"-{name}")
        except OSError as e:
            log.warning("could not turn the %s controller off again in %s (%s); it stays on", name, parent, e)
            keep.append([parent, name])
    if keep:
        ENABLED_FILE.write_text(json.dumps(keep))
    else:
        ENABLED_FILE.unlink(missing_ok=True)


def _rmdir(d: Path) -> None:
    """rmdir a cgroup, retrying while the tasks just killed finish leaving it."""
    for _ in range(50):
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(0.05)
    raise ThinwireError(f"cgroup {d} is still busy after its processes were killed; remove it with `rmdir {d}`.")
