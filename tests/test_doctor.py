"""``thinwire doctor``: on 2 local workers it finishes within its minute with every field of its
JSON; its advice follows the measurements (keep DDP fp32 when communication costs nothing, a codec
when it dominates); bad input is refused before any worker starts, leaving files intact."""

from __future__ import annotations

import json

import pytest

from tests.test_cli import assert_refused, thinwire

BUDGET_S = 60


@pytest.mark.slow
def test_doctor_on_two_local_workers_reports_every_field_within_budget(tmp_path, capsys):
    out = tmp_path / "doc"
    proc = thinwire("doctor", "--workload", "digits", "--nproc", "2", "--out", str(out), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r == json.loads((out / "report.json").read_text())
    assert r["elapsed_s"] < BUDGET_S and r["world_size"] == 2 and r["workload"] == "digits"
    m = r["measured"]
    assert 0 < m["no_comm_step_s"] and 0 < m["ddp_fp32_step_s"] and 0 <= m["comm_share"] < 1
    assert len(m["per_rank"]) == 2 and {q["a"] for q in m["pairs"]} == {0} and m["pairs"][0]["bps"] > 0
    assert m["allreduce"]["bus_bps"] > 0 and m["allreduce"]["alpha_s"] >= 0
    assert {c["codec"] for c in r["codecs"]} >= {"none", "int8", "bf16"}
    assert all(c["speedup"] > 0 and c["predicted_step_s"] > 0 and c["source"] == "trial" for c in r["codecs"])
    assert [s["sync"] for s in r["sync_modes"]][:1] == ["delayed"]
    rec = r["recommendation"]
    assert rec["action"] in ("keep", "compress") and rec["why"]
    assert (rec["command"] is None) == (rec["action"] == "keep")
    from thinwire.cli.doctor import show

    # a gradient too small for the wire to show: no bandwidth from the fit's noise (it printed 8000000000 Mbit/s)
    r["measured"]["allreduce"].update(times_s=[3e-4, 2.5e-4], beta_s_per_byte=1e-15, bus_bps=8e15)
    show(r)
    text = " ".join(capsys.readouterr().out.split())
    assert "the bandwidth does not show" in text and "Mbit/s bus bandwidth" not in text
    r["measured"]["allreduce"].update(times_s=[3e-4, 3e-3], beta_s_per_byte=8e-8, bus_bps=1e8)
    show(r)
    assert "100 Mbit/s bus bandwidth" in " ".join(capsys.readouterr().out.split())


def _report(comm_s: float, profile, trials: dict | None = None, hosts: int = 2, alpha_s: float = 1e-4, **kw):
    from thinwire.doctor.advise import advise

    floor = profile.compute[0].pre_s + profile.compute[0].backward_s + profile.compute[0].post_s
    ranks = [{"floor_s": floor, "ddp_s": floor + comm_s, "trials": trials or {}} for _ in range(hosts)]
    nbytes = sum(b.numel for b in profile.buckets) * 4
    beta = comm_s / nbytes  # a 2-rank ring all-reduce sends about the gradient once each way
    net = {"alpha_s": alpha_s, "beta_s_per_byte": beta}
    return advise(ranks=ranks, network=net, pairs=[], profile=profile, per_rank_batch=profile.compute[0].batch,
                  steals=True, workload="digits", **kw)


@pytest.fixture(scope="module")
def digits_profile():
    from thinwire.compress.spec import default_candidates
    from thinwire.measure.run import profile_workload

    return profile_workload(workload="digits", batch_sizes=[32], codecs=list(default_candidates()), reps=3,
                            corun=False, guard_steps=0)


def test_advice_follows_the_measurements(digits_profile):
    # a free network (no bytes, no latency: a sync mode would hide 0.1 ms per message, 5% of digits' 2 ms step on a
    # fast machine): nothing can help
    fast = _report(0.0, digits_profile, alpha_s=0.0)
    assert fast["recommendation"]["action"] == "keep" and "nothing thinwire offers" in fast["recommendation"]["why"]
    from thinwire.doctor.advise import job_args
    from thinwire.train.config import load_train_config

    job = load_train_config(None, {"workload": "digits", "batch_size": 128, "nproc": 2}, ["model.hidden=512"])
    slow = _report(5.0, digits_profile, job=job_args(job, 2))  # communication 100x the compute: compression must help
    assert slow["recommendation"]["action"] == "compress"
    # the command trains the job doctor measured: its model options, batch and workers
    assert slow["recommendation"]["command"].startswith(
        "thinwire train --workload digits --set model.hidden=512 --batch-size 128 --nproc 2 --compression ")
    assert slow["recommendation"]["codec"] != "none" and slow["codecs"][0]["speedup"] > 2
    assert slow["measured"]["comm_share"] > 0.9
    assert slow["recommendation"]["command"].endswith(f"--compression {slow['recommendation']['codec']}")
    assert {c["source"] for c in slow["codecs"]} == {"model"}


def test_a_codecs_trial_outranks_the_models_price(digits_profile):
    """The model prices compression as a large gain on a slow link; the trials say every codec was
    slower than fp32 (as on half-core hosts, where codec work costs more than its kernels): keep fp32."""
    from thinwire.compress.spec import default_candidates

    trials = {c: 1.0 if c == "none" else 1.2 for c in default_candidates()}
    r = _report(5.0, digits_profile, trials)
    assert r["recommendation"]["action"] == "keep"
    assert all(c["source"] == "trial" for c in r["codecs"]) and max(c["model_speedup"] for c in r["codecs"]) > 2
    why = " ".join(r["recommendation"]["why"].split())  # no codec helps, but averaging less often would
    best_sync = max(r["sync_modes"], key=lambda m: m["speedup"])
    assert best_sync["speedup"] > 2 and "nothing thinwire offers" not in why
    assert f"measure a sync mode that communicates less often: {best_sync['sync']} is priced" in why
    assert f"--sync {best_sync['sync']}" in why and "not predicted" in why
    trials["int8"] = 0.5
    r = _report(5.0, digits_profile, trials)
    assert r["recommendation"]["codec"] == "int8" and r["codecs"][0]["speedup"] == pytest.approx(2.0)


def test_with_the_guard_doctor_recommends_by_time_to_fp32s_loss(digits_profile):
    """The same guard as plan and auto: a codec it says does not reach fp32's loss is never recommended,
    however fast its step; the others rank by step speed-up over their sample factor."""
    from thinwire.compress.spec import default_candidates
    from thinwire.doctor.advise import apply_guard
    from thinwire.measure.file import ConvergenceRecord

    def rec(gap, factor):
        return ConvergenceRecord(factor=factor, loss=1.0 + gap, reference_loss=1.0, steps=60, world=4, gap=gap, orders=3)

    trials = {c: 1.0 for c in default_candidates()} | {"topk:ratio=0.01": 0.2, "int8": 0.5, "bf16": 0.45}
    records = {"topk:ratio=0.01": rec(0.20, 3.0), "int8": rec(0.004, 1.02), "bf16": rec(0.009, 1.3)}
    unguarded = _report(5.0, digits_profile, trials)
    assert {m["codec"] for m in unguarded["sync_modes"] if not m["sync"].startswith("gossip")} == {"topk:ratio=0.01"}
    r = apply_guard(_report(5.0, digits_profile, trials), records, "p.yaml")
    rows = {c["codec"]: c for c in r["codecs"]}
    # the sync modes are priced with the codec the guard puts first, not with topk, which it left out
    synced = [m for m in r["sync_modes"] if not m["sync"].startswith("gossip")]
    assert {m["codec"] for m in synced} == {"int8"} and len(synced) == len(unguarded["sync_modes"]) - 2
    assert [m["speedup"] for m in synced] != [m["speedup"] for m in unguarded["sync_modes"][:len(synced)]]
    assert rows["topk:ratio=0.01"]["speedup"] == pytest.approx(5.0) and rows["topk:ratio=0.01"]["time_speedup"] is None
    # bf16 steps faster than int8 (2.22x vs 2x) but needs 1.3x the samples: int8 is sooner to the target
    assert rows["int8"]["time_speedup"] == pytest.approx(2.0 / 1.02)
    assert r["recommendation"]["codec"] == "int8" and "1.02x its samples" in r["recommendation"]["why"]
    assert "topk:ratio=0.01" in r["recommendation"]["why"] and r["guard"] == "p.yaml"
    # a profile keys its records by the canonical spec (the default ratio left out): the same verdict
    canon = apply_guard(_report(5.0, digits_profile, trials), {"topk": rec(0.20, 3.0), "int8": rec(0.004, 1.02),
                                                               "bf16": rec(0.009, 1.3)}, "p.yaml")
    assert {c["codec"]: c["guard"] for c in canon["codecs"]} == {c["codec"]: c["guard"] for c in r["codecs"]}
    none_left = apply_guard(_report(5.0, digits_profile, trials), {"topk:ratio=0.01": rec(0.2, 3.0)}, "p.yaml")
    assert none_left["recommendation"]["action"] == "keep"  # no record is no promise
    assert {m["codec"] for m in none_left["sync_modes"]} == {"none"}


def test_doctor_refuses_a_guard_profile_of_another_workload(tmp_path):
    from thinwire.measure.file import save_profile
    from thinwire.measure.run import profile_workload

    prof = profile_workload(workload="digits", batch_sizes=[8], codecs=["int8"], reps=2, corun=False, guard_steps=0)
    save_profile(prof, tmp_path / "unguarded.yaml")
    proc = thinwire("doctor", "--workload", "digits", "--guard", str(tmp_path / "unguarded.yaml"), "--out", str(tmp_path / "d"))
    assert proc.returncode != 0 and "--guard:" in proc.stderr and "no convergence guard records" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "d").exists()
    proc = thinwire("doctor", "--workload", "charlm", "--guard", str(tmp_path / "unguarded.yaml"), "--out", str(tmp_path / "d"))
    assert proc.returncode != 0 and "profiles workload 'digits'" in proc.stderr and not (tmp_path / "d").exists()


def test_doctor_refuses_an_existing_folder_and_a_bad_workload(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_refused(thinwire("doctor", "--out", str(out)), "exists and is not empty")
    assert (out / "keep.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    (out / "keep.txt").unlink()  # a doctor stopped before its report (Ctrl-C): the same command runs again there
    (out / "config.yaml").write_text("workload: digits\n")
    (out / "hosts").mkdir()  # an emulated cluster's host logs (doctor --cluster)
    proc = thinwire("doctor", "--data", "/nonexistent/corpus", "--out", str(out))  # checked after the folder
    assert "exists and is not empty" not in proc.stderr and "data: path '/nonexistent/corpus'" in proc.stderr
    (out / "report.json").write_text("{}")  # a finished one is kept
    assert_refused(thinwire("doctor", "--out", str(out)), "exists and is not empty")
    assert_refused(thinwire("doctor", "--workload", "nosuch", "--out", str(tmp_path / "new")), "nosuch")
    assert not (tmp_path / "new").exists()
    assert_refused(thinwire("doctor", "--workload", "digits", "--nproc", "3", "--out", str(tmp_path / "new")),
                   r"batch_size: must be divisible by the number of workers \(3\)")
    assert not (tmp_path / "new").exists()


def test_on_a_cluster_with_a_switch_doctor_tries_int8_through_it_and_says_how_to_train_so(digits_profile):
    """``int8@switch``'s trial (the aggregator on the switch summing int8) is judged like a codec's; when it
    is the fastest, the command trains with ``--aggregation switch`` on that cluster (no one-line script
    change: the aggregator is the emulator's); the guard's record of int8 covers it."""
    from thinwire.compress.spec import default_candidates
    from thinwire.doctor.advise import apply_guard
    from thinwire.measure.file import ConvergenceRecord

    codecs = (*default_candidates(), "int8@switch")
    trials = {c: 1.0 for c in codecs} | {"int8": 0.6, "int8@switch": 0.5}
    r = _report(5.0, digits_profile, trials, hosts=4, codecs=codecs, cluster="spec.yaml")
    rec = r["recommendation"]
    assert rec["codec"] == "int8@switch" and rec["speedup"] == pytest.approx(2.0)
    assert rec["command"] == "thinwire train --workload digits --cluster spec.yaml --compression int8 --aggregation switch"
    assert rec["in_your_script"] is None
    switch, ring = (next(c for c in r["codecs"] if c["codec"] == n) for n in ("int8@switch", "int8"))
    assert switch["bytes_per_rank"] < 0.8 * ring["bytes_per_rank"]  # priced through the switch: 1.5x fewer at 4 hosts
    guarded = apply_guard(r, {"int8": ConvergenceRecord(factor=1.02, loss=1.004, reference_loss=1.0, steps=60, world=4,
                                                         gap=0.004, orders=3)}, "p.yaml")
    assert guarded["recommendation"]["codec"] == "int8@switch" and "--aggregation switch" in guarded["recommendation"]["command"]


def test_the_suggested_command_gives_each_model_option_back_as_it_was():
    """Options are written as --set reads them (YAML): None as null (str gave 'None', read back as a string)."""
    import shlex
    from types import SimpleNamespace

    from thinwire.config import parse_value
    from thinwire.doctor.advise import job_args

    model = {"tag": None, "flag": True, "name": "no", "digits": "1", "widths": [1, 2], "lr": 0.5, "text": "a b"}
    words = shlex.split(job_args(SimpleNamespace(workload="mine:make", model=model, data=None, batch_size=None,
                                                 cluster=None), 2))
    back = {}
    for flag, value in zip(words, words[1:]):
        if flag == "--set":
            key, text = value.split("=", 1)
            back[key.removeprefix("model.")] = parse_value(text, what=f"--set {key}")
    assert back == model


def test_a_profile_matches_a_model_whose_options_are_its_defaults_given_or_not():
    """``--set model.layers=2`` (charlm's default) was refused against a profile made without it by simulate
    and doctor's guard, while plan took it."""
    from thinwire.measure.file import Profile
    from thinwire.errors import ThinwireError
    from thinwire.sim.inputs import check_profile_matches

    prof = Profile.__new__(Profile)
    object.__setattr__(prof, "workload", "charlm")
    object.__setattr__(prof, "model", {"width": 32})
    check_profile_matches(prof, "charlm", {"width": 32, "layers": 2})
    with pytest.raises(ThinwireError, match="model options"):
        check_profile_matches(prof, "charlm", {"width": 32, "layers": 3})


def test_a_model_that_says_more_communication_than_was_measured_charges_no_negative_cost(digits_profile):
    """A profile with one slow outlier step prices a large straggler allowance; where the model's DDP step then
    exceeds the measured one, the difference was charged per byte as a negative cost, and every codec that sends
    fewer bytes came out slower than DDP fp32 (0.74-0.85x)."""
    import dataclasses

    noisy = dataclasses.replace(digits_profile, compute=[dataclasses.replace(c, std_s=c.backward_s * 5)
                                                         for c in digits_profile.compute])
    r = _report(0.002, noisy)
    assert r["model"]["charged_per_byte_s"] >= 0 and r["model"]["unexplained_comm_s"] >= 0
    assert all(c["model_speedup"] >= 1 - 1e-9 for c in r["codecs"]), [(c["codec"], c["model_speedup"])
                                                                     for c in r["codecs"]]
    one = _report(0.002, digits_profile, hosts=1)  # a single rank: its DDP step's excess over the floor is noise
    assert one["measured"]["comm_share"] == 0 and one["model"]["unexplained_comm_s"] == 0
