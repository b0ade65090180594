"""Shared fixtures: CPU-only, quiet threads, and no child process left behind."""

from __future__ import annotations

import os
import signal

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(entry))
            out.extend(_children(int(entry)))
    return out


@pytest.fixture(autouse=True)
def reap_children():
    """Kill any process a test started and left running (workers, agents)."""
    yield
    for pid in _children(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
