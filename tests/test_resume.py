"""Resume is exact and a killed worker costs only the steps since the last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_cli import ROOT, thinwire

pytestmark = pytest.mark.slow


def _final_model(out: Path) -> dict:
    path = sorted((out / "checkpoints").glob("step_*.pt"))[-1]
    return torch.load(path, weights_only=True)


# charlm with int8 in buckets of 30 KB: DDP's first iteration after a resume hands over one bucket of every
# parameter where the run that was never stopped had rebuilt three, and int8's blocks then fall elsewhere
SMALL_CHARLM = ["--workload", "charlm", "--set", "model.layers=1", "--set", "model.width=32", "--batch-size", "8",
                "--set", "bucket_mb=0.03"]


@pytest.mark.parametrize("nproc, compression, workload", [(1, "none", ["--workload", "digits"]),
                                                          (2, "topk:ratio=0.05", ["--workload", "digits"]),
                                                          (2, "int8", SMALL_CHARLM),
                                                          # int8 compute: its stochastic rounding's noise goes on
                                                          (1, "none", [*SMALL_CHARLM, "--precision", "int8"])])
def test_resume_is_bit_identical(tmp_path, nproc, compression, workload):
    common = [*workload, "--nproc", str(nproc), "--compression", compression, "--eval-every", "5"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert thinwire("train", *common, "--steps", "12", "--out", str(straight)).returncode == 0
    first = thinwire("train", *common, "--steps", "6", "--out", str(split))
    assert first.returncode == 0, first.stderr
    if nproc == 2:  # only the checkpoints copied: the run's config comes from its latest checkpoint, not defaults
        (split / "config.yaml").unlink()
    second = thinwire("train", "--resume", str(split), "--steps", "12")
    assert second.returncode == 0, second.stderr
    if nproc == 2:
        assert "has no config.yaml; resuming with the configuration saved in step_000000006.pt" in second.stderr
    a, b = _final_model(straight), _final_model(split)
    assert a["step"] == b["step"] == 12
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for ra, rb in zip(a["ranks"], b["ranks"]):  # error-feedback residuals continue identically
        for key, res in ra["comm"]["residuals"]["params"].items():
            assert torch.equal(res, rb["comm"]["residuals"]["params"][key]), key
    if "int8" in workload:
        summaries = [json.loads((o / "summary.json").read_text())["precision_report"] for o in (straight, split)]
        # the whole run's count (the split run's also has its first part's last validation)
        assert summaries[1]["int8_matmuls"] >= summaries[0]["int8_matmuls"] > 0, summaries
    if compression != "none":
        assert a["ranks"][0]["comm"]["residuals"]["params"], "the codec must have left residuals"
    if compression == "int8":  # the case above: DDP rebuilt its buckets, and the resumed first step averaged them so
        assert len(b["ranks"][0]["comm"]["layouts"]) == 3, b["ranks"][0]["comm"]["layouts"]
    events = [json.loads(l).get("event") for l in (split / "metrics.jsonl").read_text().splitlines()]
    assert events.count("resume") == 1
    if nproc == 1:  # already there: it says so, and the checkpoint is left as it was
        again = thinwire("train", "--resume", str(split), "--steps", "12")
        assert again.returncode == 0 and "the run is already at step 12 and --steps is 12: nothing to train" in \
            " ".join(again.stdout.split()), again.stdout[-2000:]
        assert torch.equal(_final_model(split)["model"][name], b["model"][name])
    counts = [json.loads((o / "summary.json").read_text())["compression_stats"]["counts"] for o in (straight, split)]
    assert counts[0] == counts[1] and sum(counts[0].values()) >= 12, counts  # the whole run, not the resumed part


def test_pytorchs_powersgd_hook_resumes_bit_identically(tmp_path):
    """The peer ``torch:powersgd`` kept nothing in its checkpoint: a resumed run sent two fp32 steps again and lost
    its error feedback and warm-start Q. Its memory goes with the checkpoint, regrouped by parameter where DDP's
    first buckets after the resume are not the ones it was made with (exact here: one bucket)."""
    common = ["--workload", "digits", "--nproc", "2", "--compression", "torch:powersgd:rank=2", "--eval-every", "5"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert thinwire("train", *common, "--steps", "12", "--out", str(straight)).returncode == 0
    assert thinwire("train", *common, "--steps", "6", "--out", str(split)).returncode == 0
    second = thinwire("train", "--resume", str(split), "--steps", "12")
    assert second.returncode == 0, second.stderr[-2000:]
    a, b = _final_model(straight), _final_model(split)
    assert a["step"] == b["step"] == 12 and a["ranks"][0]["comm"]["psgd_iter"] == 12
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for ra, rb in zip(a["ranks"], b["ranks"]):
        for key in ("psgd_error", "psgd_q"):
            assert ra["comm"][key].keys() == rb["comm"][key].keys()
            assert all(torch.equal(ra["comm"][key][i], rb["comm"][key][i]) for i in ra["comm"][key]), key


def test_a_run_stopped_before_its_first_checkpoint_trains_again_from_step_0_on_resume(tmp_path):
    """Its folder holds a config and a log but no checkpoint: --out says to resume it, and --resume does."""
    from tests.test_cli import assert_refused
    from thinwire.report import read_run

    out, straight = tmp_path / "stopped", tmp_path / "straight"
    common = ["--workload", "digits", "--steps", "4", "--eval-every", "2"]
    assert thinwire("train", *common, "--out", str(straight)).returncode == 0
    first = thinwire("train", *common, "--out", str(out))
    assert first.returncode == 0, first.stderr
    for path in (out / "checkpoints").glob("step_*.pt"):  # as if stopped at step 4 before its checkpoint was written
        path.unlink()
    (out / "summary.json").unlink()
    assert_refused(thinwire("train", *common, "--out", str(out)),
                   rf"already holds a run, which stopped before its first checkpoint. Train it again from step 0 with "
                   rf"--resume {out}")
    again = thinwire("train", "--resume", str(out))
    assert again.returncode == 0, again.stderr
    assert "holds no checkpoint: its run stopped before its first one" in again.stderr
    a, b = _final_model(straight), _final_model(out)
    assert a["step"] == b["step"] == 4 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    run = read_run(str(out))  # the steps trained again replace the first attempt's in the plot
    assert [p[0] for p in run.train] == [1, 2, 3, 4] and run.skipped["record redone"] == 6
    (tmp_path / "empty").mkdir()
    assert_refused(thinwire("train", "--resume", str(tmp_path / "empty")),
                   r"resume: .*empty' is not a thinwire run folder \(no \.thinwire-run, no checkpoints/\)")
    gone = thinwire("train", "--resume", str(tmp_path / "nothing-here"), "--steps", "5")
    assert_refused(gone, r"resume: '.*nothing-here' does not exist\. Pass the --out folder of an earlier run")
    assert "note" not in gone.stderr, gone.stderr  # refused first: no note on a schedule that never runs


def test_a_run_resumed_into_a_new_folder_and_stopped_before_its_first_checkpoint_goes_on_from_the_old_one(tmp_path):
    """`--resume A --out B` stopped before B's first checkpoint: `--resume B` went on from step 0 with a fresh model
    (A's steps dropped without a word); it goes on from A's checkpoint, twice over (B's config keeps naming A)."""
    common = ["--workload", "digits", "--eval-every", "2"]
    a, b, straight = tmp_path / "A", tmp_path / "B", tmp_path / "straight"
    assert thinwire("train", *common, "--steps", "6", "--out", str(straight)).returncode == 0
    assert thinwire("train", *common, "--steps", "2", "--out", str(a)).returncode == 0
    assert thinwire("train", "--resume", str(a), "--out", str(b), "--steps", "6").returncode == 0
    for path in (b / "checkpoints").glob("step_*.pt"):  # as if stopped before B's first checkpoint was written
        path.unlink()
    for _ in range(2):
        again = thinwire("train", "--resume", str(b), "--steps", "6")
        assert again.returncode == 0, again.stderr
        assert f"it had gone on from {a}: training goes on from {a / 'checkpoints'}" in " ".join(again.stderr.split())
        events = [json.loads(l) for l in (b / "metrics.jsonl").read_text().splitlines()]
        assert not any(e.get("event") == "start" for e in events), events
        x, y = _final_model(straight), _final_model(b)
        assert x["step"] == y["step"] == 6 and all(torch.equal(x["model"][k], y["model"][k]) for k in x["model"])
        for path in (b / "checkpoints").glob("step_*.pt"):
            path.unlink()


def test_a_resume_with_another_lr_weight_decay_or_batch_applies_them_and_counts_samples(tmp_path):
    """The optimizer's and scheduler's state dicts bring back the checkpoint's learning rate and weight decay:
    the ones this launch was given (and its config.yaml records) must be the ones used, and samples add up."""
    out = tmp_path / "run"
    first = thinwire("train", "--workload", "digits", "--steps", "2", "--eval-every", "2", "--out", str(out))
    assert first.returncode == 0, first.stderr
    again = thinwire("train", "--resume", str(out), "--steps", "4", "--lr", "0.01", "--set", "weight_decay=0.2",
                     "--batch-size", "32")
    assert again.returncode == 0, again.stderr
    assert "resumed with lr 0.002 -> 0.01, weight_decay 0.01 -> 0.2, batch 64 -> 32" in " ".join(again.stdout.split())
    last = _final_model(out)
    assert last["scheduler"]["base_lrs"] == [0.01]
    assert {g["weight_decay"] for g in last["optimizer"]["param_groups"]} == {0.2}
    assert last["samples"] == 2 * 64 + 2 * 32
    lrs = [json.loads(l)["lr"] for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert lrs[2] / lrs[1] > 4  # the warm-up's step 3 at the new peak: 5x the old one's slope


def _worker_pids(config: Path) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"thinwire.train.worker" in cmd and str(config).encode() in cmd:
                pids.append(int(entry))
    return pids


def _last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    text = path.read_text()
    whole = text[:text.rfind("\n") + 1]  # a line being written is read once it ends
    steps = [json.loads(l).get("step", 0) for l in whole.splitlines() if l.strip()]
    return max(steps, default=0)


def kill_a_worker_mid_run(train_args: list[str], out: Path, *, at_step: int, steps: int, workers: int = 2) -> int:
    """Start ``thinwire train ARGS --out OUT``, SIGKILL its last worker once ``at_step`` is logged, wait for the
    run to finish (it must, restarting from a checkpoint); the step the kill came at."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "thinwire", "train", *train_args, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 180
    while _last_step(out) < at_step and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    victims = _worker_pids(out / "config.yaml")
    assert len(victims) == workers and _last_step(out) < steps, "workers should be running mid-run"
    killed_at = _last_step(out)
    os.kill(victims[-1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]  # the survivors say in one line that they lost a peer
    return killed_at


def test_sigkill_worker_restarts_from_checkpoint(tmp_path):
    out = tmp_path / "run"
    killed_at = kill_a_worker_mid_run(["--workload", "digits", "--nproc", "2", "--max-restarts", "1", "--steps", "400",
                                       "--checkpoint-every", "50", "--eval-every", "100"], out, at_step=120, steps=400)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 400 and summary["restarts"] == 1
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    restart = [r for r in records if r.get("event") == "restart"]
    assert len(restart) == 1
    assert killed_at - 50 <= restart[0]["step"] <= killed_at and restart[0]["step"] % 50 == 0
    final = _final_model(out)
    assert final["step"] == 400 and len(final["ranks"]) == 2
    assert not list((out / "checkpoints").glob(".*.tmp"))


@pytest.mark.parametrize("sync", ["local:period=4,warmup=0", "diloco:period=4", "diloco:period=4,fragments=2", "delayed"])
def test_sigkill_restarts_a_sync_mode_from_its_checkpoint(tmp_path, sync):
    """A worker killed mid-period: the agent restarts both, they load every rank's own parameters,
    optimizer and the mode's state from the last checkpoint, and the run ends in step with itself."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "thinwire", "train", "--workload", "digits", "--nproc", "2",
                             "--sync", sync, "--max-restarts", "1", "--steps", "200", "--checkpoint-every", "50",
                             "--eval-every", "100", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 180
    while _last_step(out) < 70 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    victims = _worker_pids(out / "config.yaml")
    assert len(victims) == 2 and _last_step(out) < 200, "workers should be running mid-run"
    killed_at = _last_step(out)
    os.kill(victims[1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "failed (exitcode" not in output, output[-3000:]  # torch's line: ours names it
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["restarts"] == 1
    restart = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"event"' in l]
    restart = [r for r in restart if r.get("event") == "restart"]
    assert len(restart) == 1 and killed_at - 50 <= restart[0]["step"] <= killed_at
    final = _final_model(out)
    assert final["step"] == 200 and len(final["ranks"]) == 2
    if sync in ("local:period=4,warmup=0", "diloco:period=4"):
        # 200 is a multiple of the period: the last step averaged, so both ranks end on the same parameters
        a, b = (r["model"] for r in final["ranks"])
        assert all(torch.equal(a[k], b[k]) for k in a)


def _lrs(out: Path) -> dict[int, float]:
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if "lr" in r}


def test_resume_extending_steps_keeps_the_lr_horizon_unless_rescheduled(tmp_path):
    """30 steps resumed to 40: the cosine of the first start goes on (steps 31-40 at its final LR, 10%);
    with --reschedule each step gets the LR a straight 40-step run has (warm-up 20, cosine to 10%)."""
    import math
    import shutil

    base = tmp_path / "base"
    common = ["--workload", "digits", "--eval-every", "10", "--checkpoint-every", "10"]
    first = thinwire("train", *common, "--steps", "30", "--out", str(base))
    assert first.returncode == 0, first.stderr
    kept, refit = tmp_path / "kept", tmp_path / "refit"
    shutil.copytree(base, kept)
    shutil.copytree(base, refit)
    proc = thinwire("train", "--resume", str(kept), "--steps", "40")
    assert proc.returncode == 0, proc.stderr
    assert "horizon kept at 30 steps (this run has 40)" in proc.stdout
    proc = thinwire("train", "--resume", str(refit), "--steps", "40", "--reschedule")
    assert proc.returncode == 0, proc.stderr
    lr, lr_kept, lr_refit = _lrs(base), _lrs(kept), _lrs(refit)
    peak = 0.002  # each step's record holds the rate it trained at: step s at the schedule's point s - 1
    assert lr[1] == pytest.approx(peak / 20) and lr[20] == pytest.approx(peak)  # the warm-up's first and last
    assert lr[30] == pytest.approx(peak * (0.1 + 0.45 * (1 + math.cos(math.pi * 9 / 10))))
    for s in range(31, 41):
        assert lr_kept[s] == pytest.approx(0.1 * peak, rel=1e-12), s  # the numbers: 0.0002 from step 31
        straight = peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - 21) / 20)))
        assert lr_refit[s] == pytest.approx(straight, rel=1e-9), s
    assert lr_refit[31] == pytest.approx(0.0011, rel=1e-3)
    assert _final_model(kept)["lr_horizon"] == 30 and _final_model(refit)["lr_horizon"] == 40
    assert json.loads((refit / "summary.json").read_text())["lr_horizon"] == 40


def test_auto_resumes_on_its_plan_and_keeps_its_decisions(tmp_path):
    """``--compression auto`` after ``--resume``: the plan and the guard's shadow errors come from the checkpoint,
    so no warm-up runs again and nothing the warm-up's shadows ruled out is tried. Before, a resumed run
    decided at once, with no shadow errors (every candidate's read 0), and went through PowerSGD, int8 and
    top-k, each banned a window later, to fp32."""
    run = tmp_path / "run"
    common = ["--workload", "charlm", "--nproc", "2", "--compression", "auto", "--eval-every", "1000",
              "--set", "model.context=32", "--set", "model.width=64"]
    first = thinwire("train", *common, "--steps", "20", "--checkpoint-every", "10", "--out", str(run))
    assert first.returncode == 0, first.stderr
    before = json.loads((run / "summary.json").read_text())["auto_decisions"]
    assert before and before[0]["reason"] == "warm-up done", before
    second = thinwire("train", "--resume", str(run), "--steps", "40")
    assert second.returncode == 0, second.stderr
    assert "auto: resumed on its plan" in second.stdout + second.stderr
    summary = json.loads((run / "summary.json").read_text())
    decisions = summary["auto_decisions"]
    assert decisions[:len(before)] == before  # the log goes on across the resume
    assert all(d["reason"] != "warm-up done" for d in decisions[len(before):]), decisions
    shadow = before[0]["shadow_errors"]["0"]
    over = {spec for spec, err in shadow.items() if err > 0.1}
    sent = {spec.split(":")[0] for spec in over}
    assert over and not sent & set(summary["compression_stats"]["counts"]), (over, summary["compression_stats"])


def test_the_summary_records_where_a_resume_changed_the_world_size(tmp_path):
    out = tmp_path / "run"
    first = thinwire("train", "--workload", "digits", "--nproc", "2", "--steps", "6", "--out", str(out))
    assert first.returncode == 0, first.stderr
    assert json.loads((out / "summary.json").read_text())["world_sizes"] == [[0, 2]]
    second = thinwire("train", "--resume", str(out), "--nproc", "1", "--steps", "10")
    assert second.returncode == 0, second.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["world_sizes"] == [[0, 2], [6, 1]]
    third = thinwire("train", "--resume", str(out), "--nproc", "1", "--steps", "12")  # the same size: no new entry
    assert third.returncode == 0, third.stderr
    assert json.loads((out / "summary.json").read_text())["world_sizes"] == [[0, 2], [6, 1]]


def test_a_resume_with_nothing_to_train_keeps_the_summary_and_one_given_out_by_set_writes_there(tmp_path):
    """A resume at the run's last step trained nothing and rewrote summary.json without its validation; and
    ``--resume A --set out=B`` (or ``out:`` in ``--config``) went on writing into A, pruning its checkpoints."""
    run = tmp_path / "run"
    assert thinwire("train", "--workload", "digits", "--steps", "10", "--checkpoint-every", "5", "--eval-every", "5",
                    "--out", str(run)).returncode == 0
    before = (run / "summary.json").read_bytes()
    files = {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    again = thinwire("train", "--resume", str(run))
    assert again.returncode == 0, again.stderr
    assert (run / "summary.json").read_bytes() == before and json.loads(before)["val_loss"] is not None
    # nor does one with fewer --steps: its config.yaml said steps: 5 after it, and a plain --resume then trained nothing
    assert thinwire("train", "--resume", str(run), "--steps", "5").returncode == 0
    assert {name: (run / name).read_bytes() for name in files} == files  # no resume event either
    other = tmp_path / "other"
    r = thinwire("train", "--resume", str(run), "--set", f"out={other}", "--steps", "15")
    assert r.returncode == 0, r.stderr
    assert [p.name for p in sorted((other / "checkpoints").glob("step_*.pt"))] == ["step_000000015.pt"]
    assert [p.name for p in sorted((run / "checkpoints").glob("step_*.pt"))] == ["step_000000005.pt",
                                                                                 "step_000000010.pt"]
    conf = tmp_path / "c.yaml"
    conf.write_text(f"workload: digits\nout: {tmp_path / 'third'}\nsteps: 15\n")
    assert thinwire("train", "--resume", str(run), "--config", str(conf)).returncode == 0
    assert (tmp_path / "third" / "checkpoints" / "step_000000015.pt").is_file()
    assert (run / "summary.json").read_bytes() == before


def test_a_resume_refused_by_the_trainer_leaves_the_runs_config_as_it_was(tmp_path):
    """The memory budget is checked where the trainer sets up, after config.yaml was written: the refused
    resume left its budget in the run's config, and every plain --resume after it was refused again."""
    run = tmp_path / "run"
    assert thinwire("train", "--workload", "digits", "--steps", "10", "--checkpoint-every", "5",
                    "--out", str(run)).returncode == 0
    before = (run / "config.yaml").read_bytes()
    refused = thinwire("train", "--resume", str(run), "--steps", "15", "--memory-budget", "1KiB")
    assert refused.returncode != 0 and "memory_budget: must be at least" in refused.stderr, refused.stderr[-2000:]
    assert (run / "config.yaml").read_bytes() == before
    again = thinwire("train", "--resume", str(run), "--steps", "15")
    assert again.returncode == 0, again.stderr[-2000:]


def test_precision_auto_resumes_with_the_mode_its_run_chose():
    """``--precision auto`` chose again at every resume or restart, from timings that vary: a run could train
    its first part in int8 and the rest in fp32. The choice is checkpointed and resumed."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        first = thinwire("train", "--workload", "digits", "--steps", "6", "--checkpoint-every", "3", "--precision",
                         "auto", "--out", str(run))
        assert first.returncode == 0, first.stderr[-2000:]
        summary = json.loads((run / "summary.json").read_text())
        chosen = summary["precision_report"]["mode"]
        assert _final_model(run)["precision_mode"] == chosen
        # the summary (and its table) names the mode the run trained in, not "auto"
        assert summary["precision"] == chosen and summary["precision_asked"] == "auto"
        second = thinwire("train", "--resume", str(run), "--steps", "9")
        assert second.returncode == 0, second.stderr[-2000:]
        assert f"precision auto: {chosen}, as the run chose at its start" in " ".join(second.stdout.split())
        assert json.loads((run / "summary.json").read_text())["precision_report"]["mode"] == chosen


def test_a_resume_with_another_seed_or_codec_says_so(tmp_path):
    run = tmp_path / "run"
    assert thinwire("train", "--workload", "digits", "--steps", "4", "--checkpoint-every", "2",
                    "--out", str(run)).returncode == 0
    r = thinwire("train", "--resume", str(run), "--steps", "6", "--seed", "5", "--compression", "int8",
                 "--precision", "bf16")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "resumed with other settings than the checkpoint's: --seed 0 -> 5" in text, text[-2000:]
    assert "--compression none -> int8" in text and "--precision fp32 -> bf16 (the arithmetic" in text
    from tests.test_cli import assert_refused

    assert_refused(thinwire("train", "--workload", "digits", "--set", f"resume={run}"),
                   r"--set resume: must be given as the flag --resume DIR, not with --set, got '.*'. Use --resume ")
    same = thinwire("train", "--resume", str(run), "--steps", "8")
    assert "other settings" not in " ".join(same.stdout.split())


def test_a_resume_with_a_config_file_keeps_the_runs_own_config_under_the_files_keys(tmp_path):
    """--resume DIR --config FILE (or resume: in FILE): FILE's keys on the run's config.yaml, not on the defaults
    (a file without the model's options trained the defaults' model against the run's checkpoint)."""
    run = tmp_path / "run"
    tiny = ["--set", "model.layers=1", "--set", "model.width=32"]
    assert thinwire("train", "--steps", "3", "--checkpoint-every", "3", *tiny, "--out", str(run)).returncode == 0
    more = tmp_path / "more.yaml"
    more.write_text("steps: 5\nlr: 0.002\n")
    r = thinwire("train", "--resume", str(run), "--config", str(more))
    assert r.returncode == 0, r.stderr[-2000:]
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["layers"] == 1 and saved["model"]["width"] == 32 and saved["steps"] == 5
    assert saved["lr"] == 0.002
    # resume: in the file, and another folder: goes on from the run, and says so
    more.write_text(f"resume: {run}\nsteps: 7\nmodel: {{dropout: 0.0}}\n")
    r = thinwire("train", "--config", str(more), "--out", str(tmp_path / "copy"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"says resume: {run}" in " ".join(r.stderr.split())
    assert yaml.safe_load((tmp_path / "copy" / "config.yaml").read_text())["model"]["layers"] == 1


def test_a_resume_with_other_data_or_model_options_says_so_and_another_workload_is_refused(tmp_path):
    run = tmp_path / "run"
    tiny = ["--set", "model.layers=1", "--set", "model.width=32"]
    assert thinwire("train", "--steps", "2", "--checkpoint-every", "2", *tiny, "--out", str(run)).returncode == 0
    r = thinwire("train", "--resume", str(run), "--steps", "3", "--set", "model.dropout=0.5")
    assert r.returncode == 0 and "model.dropout 0.0 -> 0.5" in " ".join(r.stdout.split()), r.stdout[-2000:]
    refused = thinwire("train", "--resume", str(run), "--steps", "4", "--workload", "digits")
    assert refused.returncode == 2 and "workload: run" in refused.stderr and "trains charlm" in refused.stderr
    assert "cannot change on --resume" in refused.stderr and "model.layers" not in refused.stderr


def test_a_folder_of_another_tool_is_not_resumed(tmp_path):
    """thinwire doctor's folder holds a config.yaml but is no run: resuming it must not train into it."""
    other = tmp_path / "doctor"
    other.mkdir()
    (other / "config.yaml").write_text("workload: charlm\nsteps: 3\n")
    (other / "report.json").write_text("{}")
    r = thinwire("train", "--resume", str(other), "--steps", "3")
    assert r.returncode == 2 and "is not a thinwire run folder" in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in other.iterdir()) == ["config.yaml", "report.json"]


def test_a_run_whose_every_step_is_non_finite_stops_as_diverged(tmp_path):
    from thinwire.train.loop import MAX_SKIPPED_IN_A_ROW

    wl = tmp_path / "nanwl.py"
    wl.write_text("import torch\nimport thinwire\n"
                  "def build():\n"
                  "    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64))\n"
                  "    loss = lambda out, y: (out.squeeze(-1) - y).pow(2).mean() * float('nan')\n"
                  "    return thinwire.Workload(model=torch.nn.Linear(4, 1), train=data, val=data, loss=loss, batch_size=8)\n")
    env_path = f"{tmp_path}:{ROOT}"
    r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "nanwl:build", "--steps",
                        str(MAX_SKIPPED_IN_A_ROW + 20), "--eval-every", "1000", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": env_path}, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"training diverged: the last {MAX_SKIPPED_IN_A_ROW} step(s) all had a non-finite gradient" in \
        " ".join(r.stderr.split()), r.stderr[-2000:]
    # a shorter run of nothing but non-finite steps changed nothing either: not a success
    r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "nanwl:build", "--steps", "12",
                        "--eval-every", "1000", "--out", str(tmp_path / "short")],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": env_path}, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "training diverged: the last 12 step(s) all had a non-finite gradient" in " ".join(r.stderr.split()), \
        r.stderr[-2000:]
    said = r.stdout + r.stderr  # each skipped step once (the precision runner's logger said it a second time)
    assert said.count("step 3: non-finite gradient") == 1 and said.count("optimizer step skipped") == 12, said[-3000:]


def test_a_short_fp16_run_whose_loss_scaler_is_still_searching_is_no_divergence(tmp_path):
    """fp16's loss scaler starts at 2^16 and halves at each overflow, skipping that step: a short run (a smoke
    test) may skip every step with a finite loss. That is the scaler finding its scale, not a diverged run."""
    wl = tmp_path / "bigwl.py"
    wl.write_text("import torch\nimport thinwire\n"
                  "def build():\n"
                  "    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64))\n"
                  "    loss = lambda out, y: (out.float().squeeze(-1) - y).pow(2).mean() * 1e3\n"
                  "    return thinwire.Workload(model=torch.nn.Linear(4, 1), train=data, val=data, loss=loss, batch_size=8)\n")
    r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "bigwl:build", "--steps", "3",
                        "--precision", "fp16", "--eval-every", "1000", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}, timeout=300)
    # the scaler did search: every step skipped (said once, by the trainer's progress output)
    assert "non-finite gradient" in r.stdout + r.stderr, r.stderr[-2000:]
    assert r.returncode == 0 and "training diverged" not in r.stderr, r.stderr[-2000:]

    # one rank's loss NaN, the other's finite: every step skipped everywhere (the average is NaN), and every rank
    # calls it diverged (each decided from its own loss: one stopped, the other went on and lost it)
    wl.write_text("import torch\nimport torch.distributed as dist\nimport thinwire\n"
                  "def build():\n"
                  "    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64))\n"
                  "    bad = float('nan') if dist.is_initialized() and dist.get_rank() == 1 else 1.0\n"
                  "    loss = lambda out, y: (out.float().squeeze(-1) - y).pow(2).mean() * bad\n"
                  "    return thinwire.Workload(model=torch.nn.Linear(4, 1), train=data, val=data, loss=loss, batch_size=8)\n")
    r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "bigwl:build", "--steps", "3",
                        "--nproc", "2", "--precision", "fp16", "--eval-every", "1000", "--out", str(tmp_path / "two")],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "lost another worker" not in r.stderr and r.stderr.count("training diverged") >= 2, r.stderr[-3000:]


def test_a_resume_with_nothing_to_train_writes_no_summary_of_a_job_that_never_ran(tmp_path):
    """A run stopped at step 8 (no summary yet), resumed with --steps 4: nothing to train, and no summary.json of a
    4-step job; resumed with --steps 8 (stopped between its last checkpoint and its summary): the summary is written."""
    out = tmp_path / "run"
    first = thinwire("train", "--workload", "digits", "--steps", "8", "--checkpoint-every", "4", "--eval-every", "8",
                     "--out", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    result = json.loads((out / "summary.json").read_text())
    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    listing = sorted(p.name for p in out.iterdir())
    again = thinwire("train", "--resume", str(out), "--steps", "4")
    assert again.returncode == 0 and "nothing to train" in " ".join(again.stdout.split()), again.stdout[-2000:]
    assert sorted(p.name for p in out.iterdir()) == listing
    done = thinwire("train", "--resume", str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert done.returncode == 0 and summary["steps"] == 8, done.stderr[-2000:]
    assert summary["val_loss"] == result["val_loss"] and summary["val_accuracy"] == result["val_accuracy"]  # were None
