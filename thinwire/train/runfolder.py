"""A run folder belongs to one run: never overwritten, never written by two runs at once.

Rank 0 checks ``--out`` before anything is written, in every launch path (``thinwire train`` in one
process, ``--nproc``/``--max-restarts`` through the elastic agent, ``--cluster``, and ``thinwire
train`` running as a worker of the user's own ``torchrun``, at every start and restart):

1. the folder is new or empty: a new run;
2. its marker ``OUT/.thinwire-run`` names this run: the run restarting (torchrun restarted its
   workers), which continues from its own latest checkpoint;
3. ``--resume DIR`` with ``--out DIR`` (the default ``--out`` of a resume): the run continues in place;
4. the folder holds only a marker, ``config.yaml`` and ``hosts/``: a run was claimed there but never started
   (a launch that failed, a check inside a worker that refused it), and is taken over.

Anything else is refused and left as it was. While the run writes, the process that claimed the
folder holds an exclusive ``flock`` on it, so a second run started at the same moment (or a resume of
a run still going) is refused too. The lock is taken on the folder itself and released by the kernel
when the process ends, however it ends.

Run ids: ``thinwire train`` launching its own workers makes a fresh id each invocation (its workers
never check; it did, and holds the lock for them). Under a user's ``torchrun``, the id is torchrun's
``--rdzv-id`` (``TORCHELASTIC_RUN_ID``), which every restart keeps: a torchrun with the same
``--rdzv-id`` and ``--out`` continues that run. torchrun's default id ``none`` names no run; then the
id is the elastic agent's process (host, pid, start time), which a single-node torchrun keeps across
restarts. On several nodes pass ``--rdzv-id``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path

from thinwire.errors import ThinwireError

MARKER = ".thinwire-run"
RUN_FILES = (MARKER, "metrics.jsonl", "summary.json", "config.yaml", "checkpoints")
NEVER_STARTED = {MARKER, "config.yaml", "hosts"}  # what a run writes before its first record (hosts: --cluster logs)


def new_run_id() -> str:
    return f"thinwire-{uuid.uuid4().hex[:12]}"


def torchrun_run_id() -> str:
    """This worker's run under the user's torchrun: the same for every restart of that torchrun."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if rid and rid != "none":
        return f"torchrun-{rid}"
    agent = os.getppid()
    return f"torchrun-agent-{socket.gethostname()}-{agent}-{_start_time(agent)}"


def _start_time(pid: int) -> str:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), so a reused pid differs."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def read_marker(out: Path) -> str | None:
    """The run id in ``OUT/.thinwire-run``; None without one, ``"?"`` for an unreadable one."""
    try:
        data = json.loads((out / MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "?"
    return str(data.get("run_id")) if isinstance(data, dict) else "?"


class RunFolder:
    """Rank 0's hold on ``cfg.out`` for the run ``run_id``: checked on creation, claimed by :meth:`claim`.

    Creating it writes nothing: it locks the folder (when it exists) and refuses it unless one of the
    rules above holds. :meth:`claim` then creates the folder and writes the marker, first.
    """

    def __init__(self, cfg, run_id: str) -> None:
        self.out, self.run_id, self._fd = Path(cfg.out), run_id, None
        if self.out.exists() and not self.out.is_dir():
            raise ThinwireError(f"out: {str(self.out)!r} is a file, not a folder. Pass a new or empty --out; "
                                "nothing was changed.")
        if self.out.is_dir():
            self._lock()
        try:
            # the files a run appends to or replaces: a folder there fails the run midway (a traceback, a stray
            # .tmp) where it can be refused now
            odd = [name for name in (MARKER, "metrics.jsonl", "summary.json", "config.yaml")
                   if (self.out / name).exists() and not (self.out / name).is_file()]
            if odd:
                raise ThinwireError(f"out: {str(self.out / odd[0])!r} is a folder, where the run writes a file of that "
                                    "name. Move it away or pass another --out; nothing was changed.")
            self.kind = _classify(cfg, self.out, run_id)
        except ThinwireError:
            self.release()
            raise

    def claim(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if self._fd is None:
            self._lock()
        _write_marker(self.out, self.run_id, exclusive=self.kind == "new")

    def release(self) -> None:
        """Give the lock back before the process ends (tests; a run keeps it to the end)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _lock(self) -> None:
        fd = os.open(self.out, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return  # a file system without flock: the marker rules still hold
            raise ThinwireError(f"out: folder {str(self.out)!r} is being written by another run right now. "
                                "Wait for it to end, or pass another --out; nothing was changed.") from None
        self._fd = fd  # kept open for the life of the process: the kernel releases the lock when it ends


def _classify(cfg, out: Path, run_id: str) -> str:
    if cfg.resume and Path(cfg.resume).resolve() == out.resolve():
        return "continue"
    if out.is_dir() and read_marker(out) == run_id:
        return "own"
    found = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not found:
        return "new"
    # claimed (the marker), then refused inside a worker or by the launch: nothing to lose. Without the marker
    # a config.yaml (or hosts/) is the user's own, not a run's
    if MARKER in found and set(found) <= NEVER_STARTED:
        return "taken over"
    raise _refusal(cfg, out, found)


def _refusal(cfg, out: Path, found: list[str]) -> ThinwireError:
    where = repr(str(out))
    if not any(name in RUN_FILES for name in found) or (MARKER not in found and set(found) <= NEVER_STARTED):
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        return ThinwireError(f"out: folder {where} is not empty (it holds {shown}); a run starts in a new or empty "
                             "folder. Pass another --out; nothing was changed.")
    if cfg.resume:
        return ThinwireError(f"out: folder {where} already holds a run; resuming {cfg.resume!r} into it would mix two "
                             f"runs. Pass a new or empty --out, or leave --out out to continue {cfg.resume!r} in "
                             "place; nothing was changed.")
    if "config.yaml" in found and "summary.json" not in found and not any((out / "checkpoints").glob("step_*.pt")):
        return ThinwireError(f"out: folder {where} already holds a run, which stopped before its first checkpoint. "
                             f"Train it again from step 0 with --resume {out} (its configuration; its log goes on), "
                             "or pass another --out; nothing was changed.")
    return ThinwireError(f"out: folder {where} already holds a run. Continue it with --resume {out}, "
                         "or pass another --out; nothing was changed.")


def _write_marker(out: Path, run_id: str, exclusive: bool) -> None:
    text = json.dumps({"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                       "claimed": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n"
    path = out / MARKER
    if not exclusive:
        tmp = out / (MARKER + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ThinwireError(f"out: folder {str(out)!r} was claimed by another run a moment ago. "
                            "Pass another --out; nothing was changed.") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
