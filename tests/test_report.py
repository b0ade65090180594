"""``thinwire report`` draws loss and breakdown plots from several runs' metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from thinwire.errors import ThinwireError
from thinwire.report import report


def _run(folder, scale):
    folder.mkdir()
    lines = [{"event": "start", "step": 0}]
    for s in range(1, 41):
        lines.append({"step": s, "loss": scale / s, "samples": 32 * s, "wall_s": 0.1 * s, "step_time_s": 0.1,
                      "compute_s": 0.06, "comm_wait_s": 0.03 * scale, "bytes_sent": 100})
        if s % 10 == 0:
            lines.append({"step": s, "samples": 32 * s, "wall_s": 0.1 * s, "val_loss": scale / s + 0.1})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(l) for l in lines) + "\n")


def test_report_writes_pngs(tmp_path):
    _run(tmp_path / "a", 1.0)
    _run(tmp_path / "b", 2.0)
    paths = report([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "plots"))
    assert [p.name for p in paths] == ["loss.png", "breakdown.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_report_refuses_folder_without_metrics(tmp_path):
    with pytest.raises(ThinwireError, match=r"report: '.*' holds no metrics.jsonl"):
        report([str(tmp_path)])


# -- runs that are not clean: each is plotted, with one note of what was skipped -----------------------
def _nonfinite(folder):
    _run(folder, 1.0)
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    for i, bad in zip((5, 6, 7), ('null', '"inf"', '"-inf"')):  # how MetricsWriter writes NaN and inf
        assert json.loads(lines[i])["step"] == i
        lines[i] = lines[i].replace(f'"loss": {1.0 / i}', f'"loss": {bad}')
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _partial(folder):
    _run(folder, 1.0)
    with open(folder / "metrics.jsonl", "a") as f:
        f.write('{"step": 41, "loss": 0.02, "samp')  # the run is writing this line right now


def _no_steps(folder):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"event": "start", "step": 0, "restart_count": 0}\n')


def _non_utf8(folder):
    _run(folder, 1.0)
    with open(folder / "metrics.jsonl", "ab") as f:
        f.write(b'\xff\xfe\x00garbage\n{"event": "resume", "step": 40, "from": "/runs/caf\xe9"}\n')


def _resumed(folder):
    """Stopped after step 40, went on from its step-30 checkpoint: steps 31-40 trained again."""
    _run(folder, 1.0)
    again = [{"event": "resume", "step": 30}] + [{"step": s, "loss": 2.0 / s, "wall_s": 0.1 * s, "step_time_s": 0.1,
                                                   "compute_s": 0.06, "comm_wait_s": 0.03} for s in range(31, 41)]
    with open(folder / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in again))


def test_report_draws_a_resumed_run_as_it_stands(tmp_path):
    """The records of steps a run trained again after a resume replace the ones written before it."""
    from thinwire.report import read_run

    _resumed(tmp_path / "resumed")
    run = read_run(str(tmp_path / "resumed"))
    assert [p[0] for p in run.train] == list(range(1, 41))
    assert [p[2] for p in run.train[30:]] == [2.0 / s for s in range(31, 41)]
    assert [p[0] for p in run.val] == [10, 20, 30]  # step 40's validation belonged to the steps trained again
    assert run.skipped == {"record redone": 11}


@pytest.mark.parametrize("make, expected", [
    (_resumed, "run resumed: skipped 11 records of steps trained again after a resume or restart"),
    (_nonfinite, "run nonfinite: skipped 3 non-finite losses"),
    (_partial, "run partial: skipped 1 partial line"),
    (_no_steps, "run no_steps: no step records with a finite loss to plot"),
    (_non_utf8, "run non_utf8: skipped 2 non-UTF-8 lines"),
])
def test_report_plots_a_broken_run_and_notes_what_it_skipped(tmp_path, caplog, make, expected):
    folder = tmp_path / make.__name__.strip("_")
    make(folder)
    before = (folder / "metrics.jsonl").read_bytes()
    paths = report([str(folder)], str(tmp_path / "plots"))
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r.getMessage() for r in caplog.records if r.name == "thinwire.report"] == [expected]
    assert (folder / "metrics.jsonl").read_bytes() == before


def test_report_cli_prints_the_notes_never_a_traceback(tmp_path):
    from tests.test_cli import thinwire

    runs = []
    for make in (_nonfinite, _partial, _no_steps, _non_utf8):
        runs.append(tmp_path / make.__name__.strip("_"))
        make(runs[-1])
    _run(tmp_path / "clean", 1.0)
    proc = thinwire("report", *map(str, runs), str(tmp_path / "clean"), "--out", str(tmp_path / "plots"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.split() == [str(tmp_path / "plots" / "loss.png"), str(tmp_path / "plots" / "breakdown.png")]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("thinwire: run ")]
    assert len(notes) == 4 and not any("clean" in n for n in notes), proc.stderr


def test_scan_metrics_never_raises_on_content(tmp_path):
    from thinwire.train.metrics import scan_metrics

    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 1.0}\n' + b"[" * 100_000 + b"\n"
                                             + b"7" * 5000 + b"\n[1, 2]\n{\"step\": 2, \"loss\": NaN}\n")
    records, skipped = scan_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert skipped == {"unreadable line": 3}


def test_a_run_folder_that_cannot_take_the_plots_is_refused_in_one_line(tmp_path):
    """Without --out the plots go into the first run's folder: one that cannot be written is named up front."""
    import shutil
    import subprocess

    from tests.test_cli import assert_refused, thinwire

    _run(tmp_path / "a", 1.0)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(tmp_path / "a")]).returncode != 0:
        pytest.skip("needs chattr +i (root on a file system that has it): root may write any folder otherwise")
    try:
        assert_refused(thinwire("report", str(tmp_path / "a")), r"--out: must be a folder that can be written, got "
                       r"'.*a'\. .* cannot take new files")
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "a")])
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["metrics.jsonl"]


def test_runs_whose_folders_share_a_name_get_names_that_tell_them_apart(tmp_path):
    from thinwire.report import _runs

    (tmp_path / "int8").mkdir()
    (tmp_path / "fp32").mkdir()
    _run(tmp_path / "int8" / "run", 1.0)
    _run(tmp_path / "fp32" / "run", 2.0)
    _run(tmp_path / "solo", 3.0)
    names = [r.name for r in _runs([str(tmp_path / "int8" / "run"), str(tmp_path / "fp32" / "run"), str(tmp_path / "solo")])]
    assert names == ["int8/run", "fp32/run", "solo"]


def test_a_record_cut_short_by_a_crash_does_not_swallow_the_next_runs_first(tmp_path):
    """A crash mid-write leaves a last line without its newline; the resumed run's first record (its resume
    event) was glued onto it and lost with it."""
    from thinwire.train.metrics import MetricsWriter, scan_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    w = MetricsWriter(tmp_path, enabled=True)
    w.write({"event": "resume", "step": 1})
    w.close()
    records, skipped = scan_metrics(tmp_path)
    assert records == [{"step": 1, "loss": 2.0}, {"event": "resume", "step": 1}] and sum(skipped.values()) == 1


# -- the output folder: files thinwire did not write are never replaced -----------------------------------
def test_report_and_simulate_refuse_an_out_folder_holding_files_they_did_not_write(tmp_path):
    """A folder with the user's own loss.png (or simulate.json): refused, the file intact; a folder the command
    wrote before, or a run's own folder, takes its plots again."""
    from tests.test_cli import assert_refused, thinwire
    from tests.test_pipeline import _layered_profile

    from thinwire.measure.file import save_profile

    _run(tmp_path / "a", 1.0)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "loss.png").write_text("my plot")
    assert_refused(thinwire("report", str(tmp_path / "a"), "--out", str(mine)),
                   r"holds loss.png, which `thinwire report` would replace and cannot tell it wrote")
    assert (mine / "loss.png").read_text() == "my plot"
    for _ in range(2):
        assert thinwire("report", str(tmp_path / "a"), "--out", str(tmp_path / "plots")).returncode == 0
    (tmp_path / "a" / "loss.png").write_text("my plot")  # a run's copy without its marker: refused too, named
    assert_refused(thinwire("report", str(tmp_path / "a")), r"--out: .* holds loss.png, which `thinwire report` would "
                   r"replace and cannot tell it wrote")
    assert (tmp_path / "a" / "loss.png").read_text() == "my plot"
    (tmp_path / "a" / ".thinwire-run").touch()
    assert thinwire("report", str(tmp_path / "a")).returncode == 0 and (tmp_path / "a" / "loss.png").stat().st_size > 1000

    spec, prof = tmp_path / "c.yaml", tmp_path / "p.yaml"
    spec.write_text("name: pp\ndefaults: {bandwidth: 1gbit}\nhosts: [{name: h0}, {name: h1}]\n")
    save_profile(_layered_profile(), prof)
    (mine / "simulate.json").write_text("my notes")
    args = ["simulate", "--profile", str(prof), "--cluster", str(spec), "--workload", "charlm"]
    assert_refused(thinwire(*args, "--out", str(mine)), r"holds simulate.json, which `thinwire simulate` would replace and cannot tell it wrote")
    assert (mine / "simulate.json").read_text() == "my notes"
    for _ in range(2):
        r = thinwire(*args, "--out", str(tmp_path / "sim"))
        assert r.returncode == 0, r.stderr



def test_a_report_that_fails_before_writing_leaves_no_mark(tmp_path, capsys):
    """A failed report marks nothing: a later report would take the folder's own loss.png for its own."""
    from thinwire.cli.main import main

    figs = tmp_path / "figs"
    figs.mkdir()
    assert main(["report", str(tmp_path / "no_such_run"), "--out", str(figs)]) != 0
    assert not list(figs.iterdir())
    (figs / "loss.png").write_text("my plot")
    _run(tmp_path / "a", 1.0)
    assert main(["report", str(tmp_path / "a"), "--out", str(figs)]) == 2
    assert "cannot tell it wrote" in capsys.readouterr().err
    assert (figs / "loss.png").read_text() == "my plot"
