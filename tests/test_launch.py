"""``thinwire train --nproc 2`` under torchrun's agent: nothing listens beyond loopback, and a stop
signal (Ctrl-C, SIGTERM, SIGHUP) ends the run in one line with exit 128+signum, checkpoints intact."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli import ROOT
from thinwire.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listeners from Linux's /proc/net")]


def _start(out: Path, *extra: str) -> subprocess.Popen:
    """A long digits run in its own session, as a shell starts a foreground job."""
    args = [sys.executable, "-m", "thinwire", "train", "--workload", "digits", "--steps", "100000",
            "--checkpoint-every", "20", "--eval-every", "100000", "--threads", "1", "--out", str(out), *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_checkpoint(out: Path, proc: subprocess.Popen, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while ckpt.latest(out) is None:
        assert proc.poll() is None, f"run ended early ({proc.returncode}): {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within the time limit"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen, out: Path) -> None:
    """End the run and its workers (which the agent starts in sessions of their own)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    for pid in _running_with(str(out)):
        os.kill(pid, signal.SIGKILL)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parents.items() if pp == p]
    return out


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} addresses: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listeners(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket held by ``pids``."""
    inodes, found = _socket_inodes(pids), []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN
                addr, port = cols[1].split(":")
                found.append((str(_address(addr)), int(port, 16)))
    return found


def test_address_decoding():
    assert _address("0100007F") == ipaddress.ip_address("127.0.0.1")
    assert _address("00000000000000000000000000000000") == ipaddress.ip_address("::")
    assert _address("0000000000000000FFFF00000100007F") == ipaddress.ip_address("::ffff:127.0.0.1")


def test_nproc_run_listens_on_loopback_only(tmp_path):
    """The agent's two stores and the workers' gloo listeners, all on 127.0.0.1 (they were on ``*``)."""
    out = tmp_path / "run"
    proc = _start(out, "--nproc", "2")
    try:
        _wait_checkpoint(out, proc)
        found = listeners(_tree(proc.pid))
    finally:
        _stop(proc, out)
    assert len(found) >= 4, found  # rendezvous store, shared store, one gloo listener per worker
    loopback = {"127.0.0.1", "::ffff:127.0.0.1"}
    assert [(a, p) for a, p in found if a not in loopback] == []


@pytest.mark.parametrize("signum, to_group, nproc", [
    (signal.SIGINT, True, 2),    # Ctrl-C: the terminal signals the agent and the workers
    (signal.SIGTERM, False, 2),  # `kill PID` of the agent alone: it stops the workers
    (signal.SIGHUP, False, 1),   # a closed terminal, one process (no agent)
])
def test_stop_signal_ends_the_run_in_one_line(tmp_path, signum, to_group, nproc):
    out = tmp_path / "run"
    proc = _start(out, "--nproc", str(nproc))
    try:
        _wait_checkpoint(out, proc)
        (os.killpg if to_group else os.kill)(proc.pid, signum)
        _, err = proc.communicate(timeout=60)
        left = _running_with(str(out))
    finally:
        _stop(proc, out)
    assert proc.returncode == 128 + signum, err[-3000:]
    name = signal.Signals(signum).name
    assert err.strip().splitlines() == [f"thinwire: stopped by {name}; everything already saved is kept"], err[-3000:]
    state = ckpt.load(ckpt.latest(out))  # intact: loads, and is one the run had reached
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines() if l.endswith("}") and '"step"' in l]
    assert 0 < state["step"] <= max(steps)
    assert left == []  # no worker left behind


def _running_with(text: str) -> list[int]:
    """Processes whose command line mentions ``text``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry))
        except OSError:
            continue
    return found
