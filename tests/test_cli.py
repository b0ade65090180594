"""The CLI refuses bad input with one clear paragraph, a non-zero exit, and nothing overwritten."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def thinwire(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "thinwire", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def assert_refused(proc: subprocess.CompletedProcess, pattern: str) -> None:
    import re

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert re.search(pattern, proc.stderr), proc.stderr


@pytest.mark.parametrize("args, pattern", [
    (["--nproc", "0"], r"nproc: must be an integer in \[1, 4096\], got 0"),
    (["--data", "/nonexistent/corpus"], r"data: path '/nonexistent/corpus' does not exist"),
    (["--data", "/dev/null"], r"data: '/dev/null' is neither a file nor a folder \(a device, a pipe\?\)\. Pass a text"),
    (["--workload", "digits", "--nproc", "3"], r"batch_size: must be divisible by the number of workers \(3\).*got 64. Use 66 or 63"),
    (["--workload", "nosuch"], r"workload: must be one of charlm, digits or package.module:function, got 'nosuch'"),
    (["--workload", "digits", "--set", "model.depth=3"], r"model.depth: must be one of the known fields"),
    (["--compression", "zstd"], r"compression: must be one of .*none.*got 'zstd'"),
    (["--workload", "digits", "--batch-size", "100000", "--steps", "1"],  # a MemoryError's traceback at 10**9
     r"batch_size: 100000 is \d+x the training set \(\d+ items\).*at most \d+"),
])
def test_bad_input_is_refused(tmp_path, args, pattern):
    proc = thinwire("train", *args, "--out", str(tmp_path / "run"))
    assert_refused(proc, pattern)
    assert not (tmp_path / "run").exists()


def test_a_config_with_a_key_twice_a_file_to_resume_and_a_set_a_flag_overrides(tmp_path):
    """YAML's keys are unique (PyYAML kept the last in silence); --resume names a folder; a --set that a flag
    overrides is said, not dropped in silence."""
    (tmp_path / "dup.yaml").write_text("workload: digits\nsteps: 3\nsteps: 5\n")
    assert_refused(thinwire("train", "--config", str(tmp_path / "dup.yaml"), "--out", str(tmp_path / "run")),
                   r"config file .*dup.yaml.*: must be a mapping whose keys are unique, got 'steps'.*line 3")
    (tmp_path / "afile").write_text("x")
    assert_refused(thinwire("train", "--resume", str(tmp_path / "afile")), r"resume: .*afile' is a file, not a run folder")
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "run").exists()
    from thinwire.train.config import load_train_config

    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        cfg = load_train_config(None, {"steps": 3}, ["steps=5", "lr=0.1"])
    assert (cfg.steps, cfg.lr) == (3, 0.1)
    assert "--set steps=5 is overridden by the flag --steps 3" in err.getvalue()


CLUSTER_YAML = str(ROOT / "examples" / "clusters" / "pair-100mbit.yaml")


@pytest.mark.parametrize("command, args, kind", [
    ("train", ["--workload", "digits", "--steps", "2"], "folder"),
    ("profile", ["--workload", "digits", "--batch-sizes", "8"], "file"),
    ("plan", ["--workload", "digits", "--cluster", CLUSTER_YAML], "file"),
    ("simulate", ["--workload", "digits", "--cluster", CLUSTER_YAML], "folder"),
    ("doctor", ["--workload", "digits"], "folder"),
])
def test_an_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, command, args, kind):
    """A profile or a doctor run took its minutes, then died with a traceback on a path it could not write."""
    (tmp_path / "a_file").write_text("kept")
    proc = thinwire(command, *args, "--out", str(tmp_path / "a_file" / "out"))
    assert_refused(proc, rf"out: must be a {kind} that can be written, got '{tmp_path / 'a_file' / 'out'}'\. "
                         rf"'{tmp_path / 'a_file'}' cannot take new files \(it is not a folder\)")
    assert (tmp_path / "a_file").read_text() == "kept" and [p.name for p in tmp_path.iterdir()] == ["a_file"]
    if kind == "file":
        assert_refused(thinwire(command, *args, "--out", str(tmp_path)), rf"out: must be a file to write, got '{tmp_path}'")


def test_empty_data_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(thinwire("train", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "r")),
                   r"data: folder '.*empty' holds no text files")
    (tmp_path / "tiny.txt").write_text("abc")
    assert_refused(thinwire("train", "--data", str(tmp_path / "tiny.txt"), "--out", str(tmp_path / "r")),
                   r"data: corpus '.*tiny.txt' has 3 bytes; charlm needs at least")


def test_existing_run_is_not_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert_refused(thinwire("train", "--workload", "digits", "--out", str(out)), r"out: folder .* already holds a run")
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.slow
def test_corrupt_checkpoint_and_foreign_model(tmp_path):
    out = tmp_path / "run"
    ok = thinwire("train", "--workload", "digits", "--steps", "4", "--checkpoint-every", "2", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    ckpt = sorted((out / "checkpoints").glob("step_*.pt"))[-1]
    assert_refused(thinwire("train", "--resume", str(out), "--workload", "digits", "--set", "model.channels=8", "--steps", "6"),
                   r"checkpoint .* belongs to a different model \(shape of conv1.weight")
    good = ckpt.read_bytes()
    ckpt.write_bytes(good[: len(good) // 2])
    assert_refused(thinwire("train", "--resume", str(out), "--steps", "6"), r"checkpoint .* is corrupt, truncated or not a checkpoint")
    assert ckpt.read_bytes() == good[: len(good) // 2]  # left as it was
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4


@pytest.mark.slow
def test_digits_two_workers_reach_95_percent(tmp_path):
    """The issue's acceptance run: digits, 2 workers through torchrun's agent, 300 steps."""
    out = tmp_path / "digits"
    proc = thinwire("train", "--workload", "digits", "--nproc", "2", "--steps", "300", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 300
    assert summary["val_accuracy"] >= 0.95
    # the values the run used, the workload's defaults where the command left them out (lr was null)
    assert (summary["config"]["steps"], summary["config"]["batch_size"], summary["config"]["lr"]) == (300, 64, 2e-3)
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    assert len(steps) == 300
    for key in ("loss", "samples", "step_time_s", "compute_s", "comm_wait_s", "bytes_sent"):
        assert key in steps[-1]
    # 2 ranks ring all-reduce fp32 gradients: 2*(p-1)/p * 4 bytes per parameter per step = 4 bytes/param
    params = sum(p.numel() for p in torch.load(sorted((out / "checkpoints").glob("*.pt"))[-1], weights_only=True)["model"].values())
    assert steps[-1]["bytes_sent"] == params * 4


def test_zero_steps_or_batch_is_refused_not_taken_for_the_default(tmp_path):
    """`simulate --steps 0` priced 1000 steps and `profile --batch-size 0` measured the default batch."""
    spec = str(ROOT / "examples" / "clusters" / "plan-a-slow-cpu.yaml")
    assert_refused(thinwire("simulate", "--cluster", spec, "--workload", "digits", "--steps", "0", "--out",
                            str(tmp_path / "s")),
                   r"--steps: must be an integer >= 1, got 0")
    assert_refused(thinwire("profile", "--workload", "digits", "--batch-size", "0", "--out", str(tmp_path / "p.yaml")),
                   r"--batch-size: must be an integer >= 1, got 0")
    assert not (tmp_path / "s").exists() and not (tmp_path / "p.yaml").exists()


def test_simulate_refuses_the_switch_without_one_and_a_folder_for_a_profile(tmp_path):
    """`simulate --aggregation switch` priced an aggregator the spec does not have (train refuses it); a folder passed
    as --profile was said not to exist."""
    spec = str(ROOT / "examples" / "clusters" / "pair-100mbit.yaml")
    assert_refused(thinwire("simulate", "--cluster", spec, "--workload", "digits", "--compression", "int8",
                            "--aggregation", "switch", "--out", str(tmp_path / "s")),
                   r"--aggregation: must be a cluster spec with a switch: section \(.*pair-100mbit.yaml has none\)")
    (tmp_path / "folder").mkdir()
    assert_refused(thinwire("simulate", "--cluster", spec, "--profile", str(tmp_path / "folder"), "--out",
                            str(tmp_path / "s")), r"profile: '.*folder' is a folder, not a file")
    assert not (tmp_path / "s").exists()


def test_nproc_with_a_cluster_is_refused_not_ignored(tmp_path):
    """The world size with --cluster is the spec's hosts: --nproc 3 there was silently ignored."""
    spec = str(ROOT / "examples" / "clusters" / "pair-100mbit.yaml")
    assert_refused(thinwire("train", "--cluster", spec, "--nproc", "3", "--workload", "digits", "--out",
                            str(tmp_path / "run")), r"nproc: must be left out with --cluster SPEC, got 3\. Each of the")
    assert_refused(thinwire("doctor", "--cluster", spec, "--nproc", "3", "--workload", "digits", "--out",
                            str(tmp_path / "doc")), r"nproc: must be left out with --cluster SPEC, got 3")
    assert not (tmp_path / "run").exists() and not (tmp_path / "doc").exists()


def test_simulate_refuses_a_gossip_topology_the_hosts_cannot_form(tmp_path):
    """A torus on 2 hosts was priced (as a ring) where train refuses it."""
    spec = str(ROOT / "examples" / "clusters" / "pair-100mbit.yaml")
    assert_refused(thinwire("simulate", "--cluster", spec, "--workload", "digits", "--sync", "gossip:topology=torus",
                            "--out", str(tmp_path / "s")), r"sync\.topology: must be ring, exp2 or random with 2 hosts")
    assert_refused(thinwire("simulate", "--cluster", spec, "--workload", "digits", "--sync", "gossip:topology=torus",
                            "--hosts", "4,6,7", "--out", str(tmp_path / "s")), r"with 7 hosts")
    assert not (tmp_path / "s").exists()


def test_simulate_names_a_mistyped_pipeline_before_it_measures_a_profile(tmp_path):
    """`--pipeline foo` measured a profile first, then blamed it (digits has no per-layer costs, so a new profile
    would not help) and never named foo; it is refused at once, as train refuses it."""
    import time

    spec = str(ROOT / "examples" / "clusters" / "pair-100mbit.yaml")
    t0 = time.monotonic()
    assert_refused(thinwire("simulate", "--cluster", spec, "--workload", "digits", "--pipeline", "foo",
                            "--out", str(tmp_path / "s")), r"pipeline\.schedule: must be none or one of gpipe, 1f1b")
    assert time.monotonic() - t0 < 60 and not (tmp_path / "s").exists()


def test_a_torus_that_fewer_hosts_cannot_form_names_min_hosts(tmp_path):
    spec = str(ROOT / "examples" / "clusters" / "uneven-4.yaml")
    assert_refused(thinwire("train", "--cluster", spec, "--min-hosts", "2", "--max-restarts", "2", "--workload", "digits", "--sync",
                            "gossip:topology=torus", "--batch-size", "48", "--out", str(tmp_path / "run")),
                   r"sync\.topology: must be ring, exp2 or random with [23] hosts, which the run may have \(min_hosts 2\)"
                   r", got 'torus'\..* Raise --min-hosts to 4")
    assert not (tmp_path / "run").exists()


def test_a_local_run_no_longer_than_its_warm_up_says_no_step_is_local(tmp_path):
    """local's default warm-up is 100 synchronous steps: a 60-step run sent every gradient, and nothing said so."""
    proc = thinwire("train", "--workload", "digits", "--steps", "3", "--sync", "local:period=8", "--out",
                    str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all 3 steps are its synchronous warm-up (warmup=100)" in proc.stderr
    assert "warm-up" not in thinwire("train", "--workload", "digits", "--steps", "3", "--sync",
                                     "local:period=2,warmup=0", "--out", str(tmp_path / "two")).stderr
    # the learning rate's own warm-up (20 steps) on a 3-step run: it reached 15% of --lr, and nothing said so
    assert ("warmup_steps=20 is not below --steps 3: the learning rate rises to 0.15x its peak at most and never "
            "decays; --set warmup_steps=0 gives the whole schedule") in " ".join(proc.stderr.split())
    # auto's trial (10 + 2 x 20 steps) longer than the run: it ended without a choice, and said nothing
    proc = thinwire("train", "--workload", "digits", "--steps", "3", "--sync", "auto", "--out", str(tmp_path / "a"))
    assert proc.returncode == 0 and "(50 in all), and the run has 3: it ends before choosing" in \
        " ".join(proc.stderr.split()), proc.stderr[-2000:]
    # diloco's default period (100) on a 3-step run: no average while training, and it said nothing
    proc = thinwire("train", "--workload", "digits", "--steps", "3", "--sync", "diloco", "--out", str(tmp_path / "d"))
    assert proc.returncode == 0 and "the run has 3 local step(s) and its first average comes after 100" in proc.stderr


def test_a_lossy_codec_on_a_model_too_small_to_compress_says_so(capsys):
    """A 676-parameter model with --compression int8 sent every average in fp32 (each bucket under the hook's 4096
    bytes) while the summary said int8."""
    import torch

    from thinwire.cli.train import _small_model_note
    from thinwire.syncspec import parse_sync_spec
    from thinwire.train.config import load_train_config

    tiny, big = torch.nn.Linear(10, 60), torch.nn.Linear(100, 100)  # 660 and 10,100 parameters
    for model, comp, sync, noted in [(tiny, "int8", "allreduce", True), (tiny, "none", "allreduce", False),
                                     (big, "int8", "allreduce", False), (tiny, "int8", "gossip", False),
                                     (tiny, "bf16", "local:period=4", True)]:
        cfg = load_train_config(None, {"compression": comp, "sync": sync}, [])
        _small_model_note(cfg, model, None)
        err = " ".join(capsys.readouterr().err.split())
        assert ("take 2,640 bytes, under the 4,096 below which a bucket travels uncompressed" in err) == noted, (comp, sync)
    assert parse_sync_spec("diloco:period=100,fragments=4").sync_every == 25  # the first average's step
    assert parse_sync_spec("local:period=8").sync_every == 8


def test_cluster_bench_refuses_a_message_smaller_than_one_value(tmp_path):
    """`--sizes 2` measured a 0-byte all-reduce around the ring and failed inside the switch's workers."""
    spec = str(ROOT / "examples" / "clusters" / "pair-100mbit.yaml")
    assert_refused(thinwire("cluster", "bench", spec, "--sizes", "4KiB,2"),
                   r"--sizes: must be message sizes of at least 4 bytes \(one fp32 value\), got 2")


def test_a_memory_budget_no_batch_fits_leaves_no_run_behind(tmp_path):
    r = thinwire("train", "--steps", "3", "--set", "model.layers=1", "--set", "model.width=32", "--memory-budget",
                 "1B", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_plan_and_profile_do_not_write_over_a_file_of_another_kind(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("workload: charlm\nsteps: 3\n")
    r = thinwire("plan", "--cluster", str(ROOT / "examples" / "clusters" / "plan-a-slow-cpu.yaml"), "--workload", "digits",
                 "--out", str(config))
    assert_refused(r, r"--out: must be a new file, or a plan to replace.*exists and is not a plan thinwire wrote")
    r = thinwire("profile", "--workload", "digits", "--out", str(config))
    assert_refused(r, r"--out: must be a new file, or a profile to replace")
    assert config.read_text() == "workload: charlm\nsteps: 3\n"


def test_simulate_refuses_a_host_series_that_passes_its_last_term_and_report_a_missing_folder(tmp_path):
    r = thinwire("simulate", "--cluster", str(ROOT / "examples" / "clusters" / "plan-a-slow-cpu.yaml"), "--hosts",
                 "2,4,...,10", "--out", str(tmp_path / "sim"))
    assert_refused(r, r"2,4,\.\.\. multiplies by 2 at each term, which passes 10 by: it goes 8, 16")
    assert_refused(thinwire("report", str(tmp_path / "nope")), r"report: .*nope' does not exist")


@pytest.mark.parametrize("args, pattern", [
    (["--retries", "-1"], r"--retries: must be an integer >= 0"),
    (["--max-foreign", "0.5"], r"--max-foreign: must be a number of cores >= 0, used with --validate"),
])
def test_simulate_checks_the_validation_flags_without_validate_too(tmp_path, args, pattern):
    r = thinwire("simulate", "--cluster", str(ROOT / "examples" / "clusters" / "plan-a-slow-cpu.yaml"), *args,
                 "--out", str(tmp_path / "sim"))
    assert_refused(r, pattern)


def test_a_default_profile_measures_every_codec_that_plan_auto_and_doctor_try_by_default():
    """plan, auto and doctor try powersgd:rank=8; a default profile measured rank 4 only, so a default profile and
    a default plan always left powersgd out ("the profile has no measured cost for it")."""
    from thinwire.cli.profile import default_profile_codecs
    from thinwire.compress.spec import REGISTRY, default_candidates, parse_codec_spec, spec_string

    canon = lambda specs: [spec_string(parse_codec_spec(s)) for s in specs]  # noqa: E731
    measured = canon(default_profile_codecs())
    assert set(canon(default_candidates())) <= set(measured) and set(canon(REGISTRY.names())) <= set(measured)
    assert len(measured) == len(set(measured))  # none twice


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["train", "--steps", "many"], ["nonsense"]])
def test_help_and_a_mistyped_command_line_answer_before_torch_is_loaded(argv):
    code = ("import sys\nfrom thinwire.cli.main import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout + done.stderr


@pytest.mark.slow
def test_a_closed_stdout_ends_the_output_not_the_run(tmp_path):
    """``thinwire train ... | head -1``: rank 0's next line found the pipe closed and rich exited with status 1;
    the steps since the last checkpoint were lost and the other worker reported a lost connection."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "thinwire", "train", "--workload", "digits", "--nproc", "2",
                             "--steps", "40", "--eval-every", "10", "--checkpoint-every", "20", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "step 10: val_loss" in proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert json.loads((out / "summary.json").read_text())["steps"] == 40 and "Traceback" not in err, err


@pytest.mark.slow
def test_the_progress_bars_last_frame_shows_the_last_validation(tmp_path):
    """On a terminal the bar kept step 10's validation loss at 20/20 (the bar moved before step 20 validated)."""
    import pty
    import re

    leader, follower = pty.openpty()
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "thinwire", "train", "--workload", "digits", "--steps", "20",
                             "--eval-every", "10", "--out", str(out)], stdout=follower, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    os.close(follower)
    screen = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(leader)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))  # colours and cursor moves
    frames = re.findall(r"20/20 loss [\d.]+ val ([\d.]+)", text)
    final = json.loads((out / "summary.json").read_text())["val_loss"]
    assert frames and float(frames[-1]) == pytest.approx(final, abs=6e-4), (frames, final)


@pytest.mark.parametrize("text", ["8,,4", "8,4,", ",8"])
def test_profile_batch_sizes_with_an_empty_entry_are_refused(text):
    """``--batch-sizes 8,,4`` was read as 8,4: a typo measured something else without a word."""
    from thinwire.cli.profile import parse_ints
    from thinwire.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--batch-sizes: must be comma-separated integers such as 12,8,6"):
        parse_ints(text, "--batch-sizes")
    assert parse_ints(" 12, 8 ,6", "--batch-sizes") == [12, 8, 6]
