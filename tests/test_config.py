"""Config loading: unknown keys, wrong types and out-of-range values are refused by name."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from thinwire.config import from_dict
from thinwire.errors import ConfigError, ThinwireError
from thinwire.train.config import TrainConfig, load_train_config
from thinwire.workloads.charlm import CharLMConfig


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("workload: digits\nsteps: 50\nmodel: {channels: 8}\n")
    cfg = load_train_config(str(f), {"steps": 70, "lr": None}, ["model.hidden=32", "seed=3"])
    assert (cfg.workload, cfg.steps, cfg.seed, cfg.model) == ("digits", 70, 3, {"channels": 8, "hidden": 32})


@pytest.mark.parametrize("data, message", [
    ({"stepz": 10}, r"stepz: must be one of the known fields \(.*steps.*\), got 10. Remove or rename the key."),
    ({"steps": "ten"}, r"steps: must be an integer or null, got 'ten'"),
    ({"steps": 0}, r"steps: must be an integer in \[1, 1000000000000\], got 0"),
    ({"nproc": 0}, r"nproc: must be an integer in \[1, 4096\], got 0. Use --nproc 1 for a single process."),
    ({"lr": -1.0}, r"lr: must be a finite number in \(0, 10\], got -1.0"),
    ({"precision": "fp8"}, r"precision: must be one of 'fp32', 'bf16', 'fp16', 'int8', 'auto', got 'fp8'"),
    ({"error_feedback": "yes"}, r"error_feedback: must be true or false, got 'yes'"),
    ({"data": " "}, r"data: must be a path to a text file or folder, got ' '"),
    # a spec's keys written as a mapping: the string form, in a file and on the command line
    ({"pipeline": {"schedule": "1f1b", "stages": 2}}, r"pipeline: must be a string, got .*A pipeline spec is one "
                                                      r"string.*pipeline: '1f1b:stages=2,microbatches=8' in a config"),
    ({"sync": {"period": 2}}, r"sync: must be a string.*--sync local:period=8 or --set sync=local:period=8"),
])
def test_train_config_rejections(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(TrainConfig, data, where="")


def test_model_options_validated_by_workload():
    with pytest.raises(ConfigError, match=r"model.heads: must be a divisor of model.width \(128\), got 5"):
        from_dict(CharLMConfig, {"heads": 5}, where="model")
    with pytest.raises(ConfigError, match=r"model.depth: must be one of the known fields"):
        from_dict(CharLMConfig, {"depth": 5}, where="model")


def test_config_file_errors(tmp_path):
    with pytest.raises(ThinwireError, match=r"config file '.*missing.yaml' does not exist"):
        load_train_config(str(tmp_path / "missing.yaml"), {}, [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match=r"config file '.*bad.yaml': must be valid YAML, got 'line 2, column 1'. "
                                          r"While parsing a flow"):
        load_train_config(str(bad), {}, [])
    bad.write_text("steps: 5\nmodel:\n  width: 32\n" + "# a long comment " * 10 + "\n layers: 1\n")  # line 5
    with pytest.raises(ConfigError, match=r"must be valid YAML, got 'line 5, column 2'. While parsing a block mapping"):
        load_train_config(str(bad), {}, [])
    bad.write_text("steps: 5\n\tmodel: 3\n")
    with pytest.raises(ConfigError, match=r"got 'line 2, column 1'. .*found character '\\t' that cannot start"):
        load_train_config(str(bad), {}, [])
    bad.write_text("workload: digits\nsteps: ten\n")  # a value from the file: the error says which file
    with pytest.raises(ConfigError, match=r"steps: must be an integer or null, got 'ten'. It is in config file '.*bad"):
        load_train_config(str(bad), {}, [])
    with pytest.raises(ConfigError, match=r"steps: must be an integer or null, got 'x'$"):  # from --set: no file named
        load_train_config(str(bad), {}, ["steps=x"])
    with pytest.raises(ConfigError, match=r"--set: must be KEY=VALUE"):
        load_train_config(None, {}, ["steps"])
    # a codec's own parameter is no key of the config: it is the file's only where the file names the codec
    bad.write_text("workload: digits\nsteps: 2\n")
    for flags, sets in (({"compression": "int8:block=7"}, []), ({}, ["compression=int8:block=7"])):
        with pytest.raises(ConfigError, match=r"int8.block: must be an integer in \[8, 65536\], got 7. E.g. int8:block=256.$"):
            load_train_config(str(bad), flags, sets)
    bad.write_text("workload: digits\ncompression: int8:block=7\n")
    with pytest.raises(ConfigError, match=r"int8.block: .*got 7. .*It is in config file '.*bad"):
        load_train_config(str(bad), {}, [])


def test_a_run_folder_written_with_a_tilde_in_a_config_is_under_home(tmp_path, monkeypatch):
    """``out: ~/x`` in YAML (or --set out=~/x) made a folder named '~' in the working directory."""

    from thinwire.cli.train import FLAGS, resolve_config

    monkeypatch.setenv("HOME", str(tmp_path))
    args = argparse.Namespace(**{**{k: None for k in FLAGS}, "config": None, "resume": None, "set": ["out=~/runs/x"]})
    assert resolve_config(args).out == str(tmp_path / "runs" / "x")


def test_a_default_folder_named_by_the_second_is_never_shared(tmp_path):
    """Two runs in the same second (a script's loop over codecs) each get a folder of their own, created."""
    from thinwire.config import new_folder

    base = tmp_path / "runs" / "simulate-x-20261206-120000"
    got = [new_folder(base) for _ in range(3)]
    assert [p.name for p in got] == [base.name, f"{base.name}-2", f"{base.name}-3"] and all(p.is_dir() for p in got)


def test_a_user_workloads_option_at_its_default_is_the_same_model(tmp_path, monkeypatch):
    """`--set model.hidden=32` where the user's build() defaults hidden to 32 names the model left out: simulate and
    plan refused its own profile as "another model"; a module that cannot be imported has no defaults here."""
    from thinwire.plan.planfile import normalized_model
    from thinwire.workloads.registry import model_defaults

    (tmp_path / "mywl.py").write_text("def build(hidden=32, act='relu', data=None, layers=[1], *, deep=False):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert model_defaults("mywl:build") == {"hidden": 32, "act": "relu", "deep": False}
    assert normalized_model("mywl:build", {"hidden": 32}) == normalized_model("mywl:build", {})
    assert normalized_model("mywl:build", {"hidden": 64}) != normalized_model("mywl:build", {})
    assert model_defaults("no_such_module_here:build") == {}


def test_a_file_of_another_kind_is_named_as_such(tmp_path):
    """A cluster spec passed as --profile, a profile as --plan: 'is not a profile' (was: its first key is not a
    profile's field, with the 26 that are)."""
    from thinwire.measure.file import load_profile
    from thinwire.plan.planfile import read_plan

    spec = tmp_path / "spec.yaml"
    spec.write_text("name: edge\ndefaults: {bandwidth: 100mbit}\nhosts: [{name: h0}, {name: h1}]\n")
    with pytest.raises(ThinwireError, match=r"^profile: .*spec.yaml' is not a profile: it lacks workload, .* and holds "
                                            r"defaults, hosts, name, keys no profile has"):
        load_profile(spec)
    with pytest.raises(ThinwireError, match=r"^plan: .*spec.yaml' is not a plan"):
        read_plan(spec)
    prof = tmp_path / "p.yaml"  # a profile with one typo: the typo is named, as before
    prof.write_text("workload: charlm\nparameters: 10\ncompute: []\nbuckets: []\nthreadz: 1\n")
    with pytest.raises(ConfigError, match=r"^profile.threadz: must be one of the known fields"):
        load_profile(prof)


def test_trains_default_folder_taken_in_the_same_second_gets_a_number(tmp_path, monkeypatch):
    """`thinwire train` twice in one second without --out: the second refused ("claimed by another run") where
    its default folder, named by the second, was the first's; it now takes NAME-2 (and creates nothing itself)."""
    import datetime

    from thinwire.cli.train import FLAGS, resolve_config

    monkeypatch.chdir(tmp_path)

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 12, 7, 12, 0, 0)

    monkeypatch.setattr(datetime, "datetime", Frozen)
    args = argparse.Namespace(**{**{k: None for k in FLAGS}, "config": None, "resume": None, "set": [],
                                 "workload": "digits"})
    first = resolve_config(args).out
    assert first == str(Path("runs") / "digits-20261207-120000") and not Path(first).exists()
    Path(first).mkdir(parents=True)
    assert resolve_config(args).out == first + "-2" and not Path(first + "-2").exists()


def test_a_set_under_a_key_the_config_file_sets_to_a_scalar_names_the_file(tmp_path):
    """`model: null` in a file and `--set model.channels=4`: "model.channels: must be a key under a mapping, got 4"
    named neither the file nor the null that was the mistake."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("workload: digits\nmodel: null\n")
    with pytest.raises(ConfigError, match=r"^model\.channels: must be a key under a mapping \(config file '.*c\.yaml' "
                                          r"sets model to None\), got 4"):
        load_train_config(str(cfg), {}, ["model.channels=4"])
