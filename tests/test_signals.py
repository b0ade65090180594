"""Stop signals as exceptions: exit codes, the chain a signal inside torch.save leaves, deferral."""

from __future__ import annotations

import os
import signal

import pytest

from thinwire.signals import Stopped, deferred, signum_of, stop_signals_raise


def test_exit_codes_follow_the_shell_convention():
    assert [Stopped(s).exit_code for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == [130, 143, 129]
    assert str(Stopped(signal.SIGTERM)) == "stopped by SIGTERM"


def test_signal_is_found_behind_the_error_it_caused():
    try:
        try:
            raise Stopped(signal.SIGHUP)
        except Stopped:
            raise RuntimeError("unexpected pos 80960 vs 80912")  # torch.save's zip writer, unwinding
    except RuntimeError as e:
        assert signum_of(e) == signal.SIGHUP
    assert signum_of(KeyboardInterrupt()) == signal.SIGINT
    assert signum_of(ValueError("x")) is None


def test_sigterm_raises_inside_and_handlers_are_restored_after():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match="SIGTERM"):
        with stop_signals_raise():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):  # the handler runs between bytecodes
                pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_deferred_holds_a_signal_until_cleanup_is_done():
    done = []
    with pytest.raises(Stopped, match="SIGHUP"):
        with stop_signals_raise():
            with deferred():
                os.kill(os.getpid(), signal.SIGHUP)
                for _ in range(10**5):
                    pass
                done.append("cleanup finished")
    assert done == ["cleanup finished"]


def test_a_lost_peer_is_told_from_gloo_and_nccl_messages():
    from thinwire.errors import lost_peer

    gloo = RuntimeError("Unable to cast [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                        "error [127.0.0.1]:44707: Connection reset by peer. This is typically caused by a remote worker "
                        "hanging or bugs in the application. GLHF! to Tensor")
    assert lost_peer(gloo) == "Read error [127.0.0.1]:44707: Connection reset by peer"
    timeout = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 300000ms "
                           "for recv operation to complete")
    assert lost_peer(timeout) == "Timed out waiting 300000ms for recv operation to complete"
    assert lost_peer(RuntimeError("NCCL error: remote process exited or there was a network error")) is not None
    # gloo, once a peer cut off mid-collective (`thinwire cluster kill`) has been waited for until timeout_s
    assert lost_peer(RuntimeError("Application timeout caused pair closure")) == "Application timeout caused pair closure"
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert lost_peer(KeyError("x")) is None
    assert lost_peer(BrokenPipeError(32, "Broken pipe")) is None  # the console's pipe, not a peer


def test_a_failed_job_is_named_by_the_worker_that_caused_it(tmp_path):
    """Once a worker dies the others lose their connections to it (exit LOST_PEER_EXIT) or are stopped by the
    agent (SIGTERM), often before the agent sees the first: the earliest failure is then not the cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from thinwire.errors import LOST_PEER_EXIT
    from thinwire.train.launch import _worker_failed

    def failure(rank, code):
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(tmp_path / "none"))

    survivor, killed = failure(0, LOST_PEER_EXIT), failure(1, -signal.SIGKILL)
    survivor.timestamp, killed.timestamp = 1, 2  # the survivor's exit was seen first
    msg = str(_worker_failed(ChildFailedError("w", {0: survivor, 1: killed}), 0, "runs/x"))
    assert msg.startswith("worker 1 was killed by SIGKILL after 0 allowed restart(s); worker 0 then lost its "
                          "connection to it"), msg
    assert "thinwire train --resume runs/x" in msg and "To enable traceback" not in msg
    stopped = failure(0, -signal.SIGTERM)  # stopped by the agent after worker 1 failed on its own
    own = failure(1, 1)
    own.message = "ValueError: bad batch"
    msg = str(_worker_failed(ChildFailedError("w", {0: stopped, 1: own}), 2))
    assert msg == "worker 1 failed (exit code 1) after 2 allowed restart(s): ValueError: bad batch", msg
    raised = failure(0, -signal.SIGTERM)  # raised, then stopped by the agent while gloo was still tearing down
    raised.message = "AttributeError: 'dict' object has no attribute 'to'"
    msg = str(_worker_failed(ChildFailedError("w", {0: raised, 1: failure(1, -signal.SIGTERM)}), 0))
    assert msg == ("worker 0 failed (stopped by SIGTERM while leaving) after 0 allowed restart(s): AttributeError: 'dict' object has no "
                   "attribute 'to'"), msg
    # a worker sent SIGTERM itself (not by the agent) catches it and leaves with 143: named as stopped, not failed
    caught, survivor = failure(1, 128 + signal.SIGTERM), failure(0, LOST_PEER_EXIT)
    msg = str(_worker_failed(ChildFailedError("w", {0: survivor, 1: caught}), 0, "runs/x"))
    assert msg.startswith("worker 1 was stopped by SIGTERM after 0 allowed restart(s); worker 0 then lost its "
                          "connection to it, and the job stopped") and "--resume runs/x" in msg, msg
    # thinwire's own error (a full disk): the worker printed its paragraph; the job's error does not repeat it
    full, survivor = failure(0, 2), failure(1, LOST_PEER_EXIT)
    full.message = "ThinwireError: cannot write runs/x/checkpoints/step_000000020.pt: No space left on device."
    msg = str(_worker_failed(ChildFailedError("w", {0: full, 1: survivor}), 0, "runs/x"))
    assert msg == ("worker 0 failed (exit code 2) after 0 allowed restart(s); worker 1 then lost its connection to it, "
                   "with the error above."), msg
    both = {0: failure(0, LOST_PEER_EXIT), 1: failure(1, LOST_PEER_EXIT)}  # a cut link: nobody died
    assert str(_worker_failed(ChildFailedError("w", both), 0)).startswith("the workers lost their connections to each other")


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.3, 1.5, 3.0])
def test_ctrl_c_while_the_workers_start_says_one_line(tmp_path, after_s):
    """Ctrl-C reaches the terminal's whole process group: the launcher and workers still importing torch. Each
    leaves quietly (a worker with 130, the launcher with its one line), whenever it lands."""
    import subprocess
    import sys
    import time

    from tests.test_cli import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "thinwire", "train", "--nproc", "2", "--workload", "digits",
                             "--steps", "300", "--out", str(tmp_path / "run")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == "thinwire: stopped by SIGINT; everything already saved is kept", out[-3000:]


def test_ctrl_c_inside_torchs_import_of_numpy_is_not_swallowed(tmp_path):
    """torch's C extension imports numpy and only warns when that import raises: a Ctrl-C landing there was
    lost (the run went on, or numpy, left half imported, failed later with a RecursionError). Here the signal
    is sent from inside numpy's import, deterministically; the launcher must still stop with its one line."""
    import subprocess
    import sys
    import textwrap

    from tests.test_cli import ROOT

    script = textwrap.dedent(f"""
        import os, signal, sys

        class CtrlCInsideNumpy:  # a finder that presses Ctrl-C as torch's import reaches numpy.linalg
            def find_spec(self, name, path=None, target=None):
                if name == "numpy.linalg":
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, CtrlCInsideNumpy())
        from thinwire.cli.main import main
        sys.exit(main(["train", "--workload", "digits", "--steps", "3", "--out", {str(tmp_path / "run")!r}]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and out.strip().splitlines()[-1] == \
        "thinwire: stopped by SIGINT; everything already saved is kept", out[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_workers_stop_when_their_launcher_is_killed(tmp_path):
    """``kill -9`` of ``thinwire train``: its workers were re-parented and trained on, writing into a run folder
    whose lock had died with the launcher. They stop within a few seconds, keeping the checkpoints."""
    import subprocess
    import sys
    import time

    from tests.test_cli import ROOT

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "thinwire", "train", "--nproc", "2", "--workload", "digits",
                             "--steps", "100000", "--checkpoint-every", "20", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)

    def workers() -> list[int]:
        found = subprocess.run(["pgrep", "-f", f"thinwire.train.worker {out}"], capture_output=True, text=True)
        return [int(p) for p in found.stdout.split()]

    try:
        deadline = time.monotonic() + 120
        while not list((out / "checkpoints").glob("step_*.pt")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(workers()) == 2, "the workers did not start"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while workers() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not workers(), "the workers trained on after their launcher was killed"
        assert list((out / "checkpoints").glob("step_*.pt"))
    finally:
        for pid in workers():
            os.kill(pid, signal.SIGKILL)


def test_a_stop_signal_after_the_command_is_done_keeps_its_exit_code(tmp_path):
    """SIGTERM in the half second a finished `thinwire train` spends leaving (the interpreter's shutdown, torch's
    exit hooks) killed it with 143 and no word: a scheduler read a complete run as failed."""
    import subprocess
    import sys

    from tests.test_cli import ROOT

    script = tmp_path / "late.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "import thinwire.cli.main as m\n"
        "m.main = lambda argv=None: 0\n"           # the command: done, exit code 0
        "real_exit = sys.exit\n"
        "def leaving(code):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"  # lands while the process leaves
        "    time.sleep(2)\n"
        "    real_exit(code)\n"
        "sys.exit = leaving\n"
        "m.run()\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.returncode, r.stderr)
