"""``--tensorboard``: the run's records as TensorBoard event files, read back with tensorboard's own reader."""

from __future__ import annotations

import pytest

from tests.test_cli import thinwire as cli




def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_files_hold_the_runs_records(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    proc = cli("train", "--workload", "digits", "--nproc", "2", "--compression", "auto", "--steps", "12",
               "--eval-every", "6", "--tensorboard", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    acc = _scalars(out / "tensorboard")
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/step_time_s", "train/compute_s", "train/comm_wait_s", "train/bytes_sent",
                "val/val_loss", "val/val_accuracy"):
        assert tag in tags, tags
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 13))
    assert [e.step for e in acc.Scalars("val/val_loss")] == [6, 12]
    import json

    last = json.loads((out / "summary.json").read_text())["val_loss"]
    assert acc.Scalars("val/val_loss")[-1].value == pytest.approx(last, rel=1e-6)
    assert {"events/text_summary", "auto/text_summary"} <= set(acc.Tags()["tensors"])  # start event, auto decisions


def test_a_resumed_run_shows_each_step_once(tmp_path):
    """Steps 7-8 logged, lost (the run stopped after its step-6 checkpoint) and trained again: TensorBoard shows
    the second ones only (SummaryWriter's purge_step), as ``thinwire report`` does."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    common = ["--workload", "digits", "--eval-every", "100", "--tensorboard", "--checkpoint-every", "6"]
    assert cli("train", *common, "--steps", "8", "--out", str(out)).returncode == 0
    (out / "checkpoints" / "step_000000008.pt").unlink()  # as if stopped before step 8's checkpoint
    proc = cli("train", "--resume", str(out), "--steps", "10")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [e.step for e in _scalars(out / "tensorboard").Scalars("train/loss")] == list(range(1, 11))


def test_a_run_resumed_before_its_first_checkpoint_shows_only_the_steps_trained_again(tmp_path):
    """Stopped before its first checkpoint, the run trains again from step 0 on --resume: the first attempt's
    steps are hidden, those it reached beyond the new run's end included."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    common = ["--workload", "digits", "--eval-every", "100", "--tensorboard", "--checkpoint-every", "100"]
    assert cli("train", *common, "--steps", "8", "--out", str(out)).returncode == 0
    for path in (out / "checkpoints").glob("step_*.pt"):  # as if stopped at step 8 before its checkpoint
        path.unlink()
    (out / "summary.json").unlink()
    proc = cli("train", "--resume", str(out), "--steps", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [e.step for e in _scalars(out / "tensorboard").Scalars("train/loss")] == list(range(1, 6))


def test_without_the_flag_no_event_files(tmp_path):
    out = tmp_path / "run"
    assert cli("train", "--workload", "digits", "--steps", "2", "--out", str(out)).returncode == 0
    assert not (out / "tensorboard").exists()


def test_missing_package_is_a_clear_error(monkeypatch):
    import sys

    from thinwire.errors import ConfigError
    from thinwire.train.metrics import check_tensorboard

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    with pytest.raises(ConfigError, match=r"tensorboard: must be used with the tensorboard package installed.*"
                                          r"pip install 'thinwire\[tensorboard\]'"):
        check_tensorboard()
