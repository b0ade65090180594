"""A run folder is never overwritten and never written by two runs, in every launch path."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_cli import ROOT, assert_refused, thinwire
from thinwire.errors import ThinwireError
from thinwire.train import runfolder
from thinwire.train.runfolder import MARKER, RunFolder


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _cfg(out, resume=None):
    return SimpleNamespace(out=str(out), resume=str(resume) if resume else None)


# -- the rules, without a run ------------------------------------------------------------------------
def test_new_and_empty_folders_are_accepted_and_claimed(tmp_path):
    assert RunFolder(_cfg(tmp_path / "new"), "r1").kind == "new"
    assert not (tmp_path / "new").exists()  # checking writes nothing
    (tmp_path / "empty").mkdir()
    folder = RunFolder(_cfg(tmp_path / "empty"), "r1")
    assert folder.kind == "new"
    folder.claim()
    assert runfolder.read_marker(tmp_path / "empty") == "r1"
    folder.release()


@pytest.mark.parametrize("name", [MARKER, "metrics.jsonl"])
def test_a_folder_where_the_run_writes_a_file_is_refused_before_anything_is_written(tmp_path, name):
    """OUT/.thinwire-run a folder: the claim failed with IsADirectoryError and left .thinwire-run.tmp behind; a resumed
    run's metrics.jsonl a folder: a traceback from the metrics writer on rank 0."""
    out = tmp_path / "run"
    (out / name).mkdir(parents=True)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ThinwireError, match=rf"^out: '.*{name}' is a folder, where the run writes a file"):
        RunFolder(_cfg(out, resume=out), "r1")
    assert sorted(p.name for p in out.iterdir()) == before


def test_restart_of_own_run_accepted_another_run_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"run_id": "torchrun-job-a"}))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = hashes(out)
    assert _kind_in_child(out, "torchrun-job-a") == "own"
    assert _kind_in_child(out, "torchrun-job-b") == f"out: folder '{out}' already holds a run. Continue it with " \
        f"--resume {out}, or pass another --out; nothing was changed."
    assert _kind_in_child(out, "torchrun-job-b", resume=out) == "continue"
    assert hashes(out) == before


def _kind_in_child(out: Path, run_id: str, resume=None) -> str:
    """RunFolder in a fresh process, so this test's own locks do not interfere."""
    code = ("import sys; from types import SimpleNamespace as N; from thinwire.train.runfolder import RunFolder\n"
            "from thinwire.errors import ThinwireError\n"
            "try: print(RunFolder(N(out=sys.argv[1], resume=sys.argv[3] or None), sys.argv[2]).kind)\n"
            "except ThinwireError as e: print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(out), run_id, str(resume or "")], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return proc.stdout.strip()


def test_never_started_folder_is_taken_over_nonempty_refused(tmp_path):
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / MARKER).write_text('{"run_id": "thinwire-old"}')
    (stale / "config.yaml").write_text("steps: 3\n")
    assert _kind_in_child(stale, "thinwire-new") == "taken over"
    (stale / "hosts").mkdir()  # a --cluster launch whose workers were refused: host logs, no step
    assert _kind_in_child(stale, "thinwire-new") == "taken over"
    (stale / "metrics.jsonl").write_text("")
    assert "already holds a run" in _kind_in_child(stale, "thinwire-new")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ThinwireError, match=r"out: folder '.*other' is not empty \(it holds notes.txt\); a run "
                                            r"starts in a new or empty folder"):
        RunFolder(_cfg(other), "r1")
    mine = tmp_path / "mine"  # the user's own config.yaml, no run's marker: not a run to take over
    mine.mkdir()
    (mine / "config.yaml").write_text("# my notes\nsteps: 5\n")
    with pytest.raises(ThinwireError, match=r"out: folder '.*mine' is not empty \(it holds config.yaml\)"):
        RunFolder(_cfg(mine), "r1")
    assert (mine / "config.yaml").read_text() == "# my notes\nsteps: 5\n"
    (other / "notes.txt").unlink()  # a refused folder is not left locked
    assert RunFolder(_cfg(other), "r1").kind == "new"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ThinwireError, match=r"out: '.*file' is a file, not a folder"):
        RunFolder(_cfg(tmp_path / "file"), "r1")


def test_folder_being_written_is_refused(tmp_path):
    first = RunFolder(_cfg(tmp_path / "run"), "r1")
    first.claim()
    with pytest.raises(ThinwireError, match=r"out: folder '.*run' is being written by another run right now"):
        RunFolder(_cfg(tmp_path / "run", resume=tmp_path / "run"), "r2")
    first.release()
    assert RunFolder(_cfg(tmp_path / "run", resume=tmp_path / "run"), "r2").kind == "continue"


def test_torchrun_run_id(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "myjob")
    assert runfolder.torchrun_run_id() == "torchrun-myjob"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default names no run: the agent does
    agent = runfolder.torchrun_run_id()
    assert agent.startswith(f"torchrun-agent-") and f"-{os.getppid()}-" in agent
    assert agent == runfolder.torchrun_run_id()


# -- the two overwrite routes, end to end ------------------------------------------------------------
DIGITS = ["--workload", "digits", "--steps", "4", "--eval-every", "2"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name in ("a", "b"):
        proc = thinwire("train", *DIGITS, "--out", str(root / name))
        assert proc.returncode == 0, proc.stderr
    return root / "a", root / "b"


def test_resume_into_another_run_is_refused(two_runs, tmp_path):
    a, b = two_runs
    before = {a: hashes(a), b: hashes(b)}
    assert_refused(thinwire("train", "--resume", str(a), "--out", str(b), "--steps", "8"),
                   r"out: folder '.*b' already holds a run; resuming '.*a' into it would mix two runs")
    (tmp_path / "notes.txt").write_text("mine")
    assert_refused(thinwire("train", "--resume", str(a), "--out", str(tmp_path), "--steps", "8"),
                   r"out: folder '.*' is not empty \(it holds notes.txt\)")
    assert {a: hashes(a), b: hashes(b)} == before
    assert (tmp_path / "notes.txt").read_text() == "mine" and len(list(tmp_path.iterdir())) == 1


def torchrun(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout)


def test_own_torchrun_into_existing_run_is_refused(two_runs):
    a, _ = two_runs
    before = hashes(a)
    proc = torchrun("--standalone", "--nproc-per-node", "1", "-m", "thinwire", "train", *DIGITS, "--out", str(a))
    assert proc.returncode != 0
    assert f"thinwire: error: out: folder '{a}' already holds a run. Continue it with --resume" in proc.stderr
    assert hashes(a) == before


def _worker_pids(out: Path) -> list[int]:
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"thinwire" in cmd and b"torch.distributed.run" not in cmd and str(out).encode() in cmd:
            pids.append(int(entry))
    return pids


def _steps(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(l) for l in lines[:-1]]  # the last line may be half written


@pytest.mark.slow
def test_own_torchrun_restart_continues_its_own_run(tmp_path):
    """Under the user's torchrun with --max-restarts, a killed worker comes back into its own folder."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "1", "--monitor-interval", "0.5", "-m", "thinwire", "train",
                             "--workload", "digits", "--steps", "300", "--checkpoint-every", "25",
                             "--eval-every", "100", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.time() + 180
    while max((r.get("step", 0) for r in _steps(out)), default=0) < 60 and time.time() < deadline \
            and proc.poll() is None:
        time.sleep(0.2)
    victims = _worker_pids(out)
    assert len(victims) == 2, "workers should be running mid-run"
    marker = (out / MARKER).read_text()
    os.kill(victims[1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["restarts"] == 1
    events = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event")]
    assert [e["event"] for e in events] == ["start", "restart"] and events[1]["step"] % 25 == 0
    assert json.loads((out / MARKER).read_text())["run_id"] == json.loads(marker)["run_id"]


def test_a_checkpoint_that_does_not_fit_the_disk_is_one_paragraph_and_leaves_the_last_one(tmp_path, monkeypatch):
    """torch.save on a full disk raises a RuntimeError ("unexpected pos 704 vs 598") raised while handling
    the OSError; it was a traceback, and the half-written temporary file stayed."""
    import errno

    import torch

    from thinwire.train import checkpoint as ckpt

    path = tmp_path / "checkpoints" / "step_000000010.pt"
    ckpt.save_atomic({"x": torch.ones(3)}, path)
    before = path.read_bytes()

    def full(obj, f):
        f.write(b"partial")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ThinwireError, match=rf"cannot write {path}: No space left on device\. Free space"):
        ckpt.save_atomic({"x": torch.zeros(3)}, path)
    assert path.read_bytes() == before and [p.name for p in path.parent.iterdir()] == [path.name]
    monkeypatch.setattr(torch, "save", lambda obj, f: (_ for _ in ()).throw(RuntimeError("a bug of ours")))
    with pytest.raises(RuntimeError, match="a bug of ours"):  # not a disk's: not dressed as one
        ckpt.save_atomic({"x": torch.zeros(3)}, path)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_a_run_on_a_full_disk_stops_with_one_line_and_says_where_to_go_on(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], check=True)
    try:
        r = thinwire("train", "--workload", "digits", "--nproc", "2", "--steps", "60", "--checkpoint-every", "10",
                     "--out", str(disk / "run"))
        text = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 2 and "Traceback" not in text and "failed (exitcode" not in text, text[-3000:]
        assert f"cannot write {disk / 'run' / 'checkpoints' / 'step_000000010.pt'}: No space left on device" in text
        assert "The run stopped at step 10; it had written no checkpoint yet" in text
        # the paragraph once (the worker's), the job's line pointing at it: it was printed twice
        assert "thinwire: error: worker 0 failed (" in text and "with the error above" in text
        assert text.count(": cannot write") == 1, text[-3000:]
        assert not list((disk / "run" / "checkpoints").iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_under_torchrun_a_start_rank_0_refuses_ends_every_rank_at_once(tmp_path):
    """Rank 0 refuses the folder; rank 1 waits in init_process_group, in C++, where Python's SIGTERM handler never
    runs: torchrun waited its 30 s grace before SIGKILL. The wait now ends at the agent's SIGTERM."""
    out = tmp_path / "trx"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "thinwire", "train", "--workload", "digits", "--steps", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    took = time.monotonic() - t0
    assert proc.returncode != 0 and "is not empty (it holds notes.txt)" in proc.stderr, proc.stderr[-2000:]
    assert took < 25 and "forcefully exiting via 9" not in proc.stderr, (took, proc.stderr[-2000:])
    assert (out / "notes.txt").read_text() == "mine"


def test_a_checkpoint_save_removes_what_a_writer_killed_mid_write_left(tmp_path):
    """A worker killed inside ``save_atomic`` leaves its temporary file (only it would remove it): the next
    checkpoint at or past that step removes it, and a shard's too; a later step's (being written) is kept."""
    from thinwire.train.checkpoint import checkpoint_dir, save

    folder = checkpoint_dir(tmp_path)
    (folder / "shards").mkdir(parents=True)
    stale = [folder / ".step_000000008.pt.zxidlz2o.tmp", folder / "shards" / ".step_000000008.rank00001.pt.ab.tmp"]
    later = folder / ".step_000000012.pt.k3j.tmp"
    for f in (*stale, later):
        f.write_bytes(b"half a checkpoint")
    save(tmp_path, {"step": 4}, keep=2)
    assert all(f.exists() for f in (*stale, later))
    save(tmp_path, {"step": 8}, keep=2)
    assert not any(f.exists() for f in stale) and later.exists()
    assert sorted(p.name for p in folder.glob("step_*.pt")) == ["step_000000004.pt", "step_000000008.pt"]


def test_a_metrics_file_deleted_under_a_run_stops_it(tmp_path):
    """`rm -rf OUT` mid-run: the run trained on into an unlinked metrics.jsonl and exited 0, every record lost
    without a word (a fresh checkpoints/ and summary.json appeared as if the run were whole)."""
    from thinwire.errors import ThinwireError
    from thinwire.train.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, enabled=True)
    w.write({"step": 1, "loss": 2.0})
    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(ThinwireError, match=r"metrics.jsonl was deleted while this run wrote it .*new --out"):
        w.write({"step": 2, "loss": 1.9})
    w.close()
