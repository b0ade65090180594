"""Issue 26's reproducers, one named test each: every malformed file or flag is a clean ConfigError
(or ThinwireError) naming the field, never a traceback, and never a message over 2 KB."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.inputs_docs import CLUSTER, PLAN, PROFILE
from thinwire.cluster.spec import ClusterSpec, load_cluster_spec
from thinwire.compress.spec import parse_codec_spec
from thinwire.config import MAX_DEPTH, dump_yaml, from_dict, parse_yaml
from thinwire.errors import MAX_MESSAGE, ConfigError, ThinwireError
from thinwire.measure.file import load_profile
from thinwire.measure.run import profile_workload
from thinwire.plan.planfile import cluster_fingerprint, load_plan, read_plan, workload_fingerprint
from thinwire.plan.planner import PlanOptions
from thinwire.sim.sweep import SimOptions
from thinwire.train import checkpoint as ckpt
from thinwire.commspec import parse_comm_spec
from thinwire.train.config import load_train_config
from thinwire.workloads.registry import check_workload_name


def write(tmp_path, text: str | bytes, name: str = "f.yaml"):
    path = tmp_path / name
    text = dump_yaml(text) if isinstance(text, dict) else text
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def cluster(**changes) -> dict:
    return {**copy.deepcopy(CLUSTER), **changes}


# -- the YAML reader ------------------------------------------------------------------------------
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("text, match", [
    pytest.param("[" * 1200 + "]" * 1200, rf"must be at most {MAX_DEPTH} levels of nesting", id="deep-nesting"),
    pytest.param("steps: " + "9" * 5000, r"must be an integer of at most 100 digits, got '9{20}.*\(5002 characters\)",
                 id="int-over-4300-digits"),
    pytest.param("{1: a, b: c}", r"must be a mapping with string keys, got '1'. Quote the key", id="mixed-keys"),
    pytest.param("{null: 1}", r"must be a mapping with string keys, got 'null'", id="null-key"),
    pytest.param(ALIAS_BOMB, r"must be written without aliases \(\*name\), got 'a'", id="alias-bomb"),
    pytest.param("a: !!python/object/apply:os.system [ls]", r"must be plain values, lists and mappings", id="tag"),
])
def test_yaml_reader_refuses(tmp_path, text, match):
    for load in (lambda p: load_train_config(str(p), {}, []), load_cluster_spec, read_plan, load_profile):
        with pytest.raises(ConfigError, match=match) as info:
            load(write(tmp_path, text))
        assert len(str(info.value)) < MAX_MESSAGE


def test_non_utf8_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*': must be UTF-8 text, got b'\\xff\\xfe.*Byte 7 is not UTF-8"):
        load_train_config(str(write(tmp_path, b"steps: \xff\xfe\n")), {}, [])


def test_yaml_is_read_as_1_2():
    assert parse_yaml("a: 1e-3\nb: 1:30\nc: off\nd: 010\ne: 2024-01-01", what="t") == {
        "a": 0.001, "b": "1:30", "c": "off", "d": 10, "e": "2024-01-01"}


def test_messages_never_echo_a_value_unbounded():
    with pytest.raises(ConfigError, match=r"steps: must be an integer or null, got 'xxx.*\(100002 characters\)$"):
        from_dict_train({"steps": "x" * 100_000})
    with pytest.raises(ConfigError) as info:
        from_dict_train({"k" * 100_000: 1})
    assert len(str(info.value)) < MAX_MESSAGE


def from_dict_train(data):
    from thinwire.train.config import TrainConfig

    return from_dict(TrainConfig, data, where="")


# -- finite numbers with ranges -------------------------------------------------------------------
@pytest.mark.parametrize("overrides, sets, match", [
    pytest.param({"memory_budget": "1e999GiB"}, [],
                 r"memory_budget: must be a positive size such as 512MiB.*\(at most 1048576TiB\), got .1e999GiB.",
                 id="memory-1e999GiB"),
    pytest.param({"lr": float("inf")}, [], r"lr: must be a finite number or null, got inf", id="lr-inf-flag"),
    pytest.param({}, ["lr=inf"], r"lr: must be a finite number or null, got 'inf'", id="lr-inf-set"),
    pytest.param({}, ["lr=.inf"], r"lr: must be a finite number or null, got inf", id="lr-.inf-set"),
    pytest.param({}, ["weight_decay=.inf"], r"weight_decay: must be a finite number, got inf", id="weight-decay-inf"),
    pytest.param({}, ["weight_decay=50"], r"weight_decay: must be a finite number in \[0, 10\], got 50", id="weight-decay-big"),
    pytest.param({}, ["timeout_s=.inf"], r"timeout_s: must be a finite number, got inf", id="timeout-inf"),
    pytest.param({"seed": 10**16}, [], r"seed: must be an integer in \[0, 4294967295\], got 10000000000000000. Seeds",
                 id="seed-1e16"),
    pytest.param({"threads": 10**9}, [], r"threads: must be an integer in \[1, 1024\], got 1000000000", id="threads"),
    pytest.param({}, ["steps=1:30"], r"steps: must be an integer or null, got '1:30'", id="sexagesimal"),
    pytest.param({}, ["steps=" + "1" * 30], r"steps: must be an integer of 64 bits or null", id="steps-huge"),
])
def test_train_config_refuses(overrides, sets, match):
    with pytest.raises(ConfigError, match=match):
        load_train_config(None, overrides, sets)


def test_set_values_are_yaml_1_2_scalars():
    cfg = load_train_config(None, {}, ["lr=1e-3", "compression=int8", "model.width=64", "data=corpus.txt"])
    assert (cfg.lr, cfg.compression, cfg.model, cfg.data) == (0.001, "int8", {"width": 64}, "corpus.txt")
    with pytest.raises(ConfigError, match=r"compression: must be one of none, .*got 'off'"):  # a string, not False
        load_train_config(None, {}, ["compression=off"])


@pytest.mark.parametrize("changes, match", [
    pytest.param({"defaults": {"bandwidth": float("inf")}}, r"defaults\.bandwidth: must be a finite number or a string",
                 id="bandwidth-inf"),
    pytest.param({"defaults": {"bandwidth": "inf"}}, r"defaults\.bandwidth \(taken by hosts\[0\]\): must be a rate", id="bandwidth-inf-text"),
    pytest.param({"defaults": {"bandwidth": "1e999mbit"}}, r"defaults\.bandwidth \(taken by hosts\[0\]\): must be a rate", id="bandwidth-1e999"),
    pytest.param({"defaults": {"bandwidth": "1mbit", "cpu": 1e-320}}, r"defaults\.cpu \(taken by hosts\[0\]\): must be a number of cores in",
                 id="cpu-1e-320"),
    pytest.param({"links": [{"between": ["g1", "g2"], "bandwidth": "1mbit", "latency": float("nan")}]},
                 r"links\[0\]\.latency: must be a finite number or a string or null, got nan", id="latency-nan"),
    pytest.param({"links": [{"between": ["g1", "g2"], "bandwidth": "1mbit", "latency": "nan ms"}]},
                 r"links\[0\]\.latency: must be a duration in \[0, 1 hour\]", id="latency-nan-text"),
    pytest.param({"hosts": [{"name": "a\n"}]}, r"hosts\[0\]\.name: must be 1-32 letters", id="host-name-newline"),
    pytest.param({"hosts": [{"group": "g1"}]}, r"hosts\[0\]\.name: must be set \(str\), got nothing. Add the field",
                 id="host-missing-name"),
    pytest.param({"hosts": [None]}, r"hosts\[0\]\.name: must be set \(str\), got nothing", id="host-null-item"),
    pytest.param({"links": [{"between": ["g1", None], "bandwidth": "1mbit"}]}, r"links\[0\]\.between\[1\]: must be a string",
                 id="link-null-group"),
    pytest.param({"links": [{"between": ["g1", "g2"]}]}, r"links\[0\]\.bandwidth: must be set", id="link-missing-rate"),
])
def test_cluster_spec_refuses(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match):
        load_cluster_spec(write(tmp_path, (cluster(**changes))))


@pytest.mark.parametrize("name", ["lab.v1", "LAB_v1", "Lab-v1", "lab_v1", "-lab", "a" * 25])
def test_cluster_names_that_share_a_tag_are_refused(name):
    with pytest.raises(ConfigError, match=r"name: must be 1-24 lowercase letters, digits or '-'.*lab-v1"):
        from_dict(ClusterSpec, cluster(name=name), where="")
    assert from_dict(ClusterSpec, cluster(name="lab-v1"), where="").name == "lab-v1"


def test_cluster_name_from_a_file_stem_must_be_a_tag(tmp_path):
    data = cluster()
    del data["name"]
    with pytest.raises(ConfigError, match=r"^name: must be 1-24 .*got 'lab.v1'"):
        load_cluster_spec(write(tmp_path, (data), "lab.v1.yaml"))


# -- plan and profile files -----------------------------------------------------------------------
def spec() -> ClusterSpec:
    return from_dict(ClusterSpec, cluster(), where="")


def plan_doc(**chosen) -> dict:
    doc = copy.deepcopy(PLAN)
    doc["cluster_fingerprint"] = cluster_fingerprint(spec())
    doc["workload_fingerprint"] = workload_fingerprint("charlm", {})
    doc["chosen"].update(chosen)
    return doc


def test_a_valid_plan_loads(tmp_path):
    plan = load_plan(write(tmp_path, (plan_doc())), spec(), "charlm", {})
    assert plan.hosts == ["a", "b"]


@pytest.mark.parametrize("chosen, match", [
    pytest.param({"hosts": ["a", "zz"]}, r"plan\.chosen\.hosts\[1\]: must be a host of the cluster \(a, b\), got 'zz'",
                 id="unknown-host"),
    pytest.param({"hosts": ["a", "a"]}, r"plan\.chosen\.hosts: must be each host once.*got 'a'", id="duplicate-host"),
    pytest.param({"codecs": ["int8", "zstd"]}, r"plan\.chosen\.codecs\[1\]: must be a codec spec .*got 'zstd'",
                 id="bad-codec"),
    pytest.param({"codecs": ["powersgd:rank=²"]}, r"plan\.chosen\.codecs\[0\]: .*powersgd\.rank: must be an integer",
                 id="codec-superscript"),
    pytest.param({"shares": [4, 4, 4]}, r"plan\.chosen\.shares: must be one entry per host \(2\)", id="shares-field"),
    pytest.param({"shares": None}, r"plan\.chosen\.shares: must be a list of int", id="shares-null"),
    pytest.param({"predicted_step_s": float("inf")}, r"plan\.chosen\.predicted_step_s: must be a finite number",
                 id="step-inf"),
])
def test_plan_refused_when_loaded(tmp_path, chosen, match):
    with pytest.raises(ConfigError, match=match):
        load_plan(write(tmp_path, (plan_doc(**chosen))), spec(), "charlm", {})


def test_plan_missing_field_is_named(tmp_path):
    doc = plan_doc()
    del doc["chosen"]["codecs"]
    with pytest.raises(ConfigError, match=r"plan\.chosen\.codecs: must be set \(list\), got nothing"):
        read_plan(write(tmp_path, (doc)))
    doc = plan_doc()
    doc["alternatives"] = [None]
    with pytest.raises(ConfigError, match=r"plan\.alternatives\[0\]\.name: must be set"):
        read_plan(write(tmp_path, (doc)))


@pytest.mark.parametrize("path, value, match", [
    pytest.param(("workload",), "DELETE", r"profile\.workload: must be set \(str\), got nothing", id="missing"),
    pytest.param(("compute",), [None], r"profile\.compute\[0\]\.batch: must be set", id="null-item"),
    pytest.param(("compute", 0, "pre_s"), float("inf"), r"profile\.compute\[0\]\.pre_s: must be a finite number",
                 id="inf"),
    pytest.param(("compute", 0, "batch"), 0, r"profile\.compute\[0\]\.batch: must be an integer in \[1, ", id="batch"),
    pytest.param(("threads",), 10**6, r"profile\.threads: must be an integer in \[1, 1024\]", id="threads"),
    pytest.param(("network", "efficiency"), 0.0, r"profile\.network\.efficiency: must be a finite number in \(0, 1\]",
                 id="efficiency"),
])
def test_profile_refused_when_loaded(tmp_path, path, value, match):
    doc = copy.deepcopy(PROFILE)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value == "DELETE":
        del node[path[-1]]
    else:
        node[path[-1]] = value
    with pytest.raises(ConfigError, match=match):
        load_profile(write(tmp_path, (doc)))


def test_a_valid_profile_loads(tmp_path):
    assert load_profile(write(tmp_path, (PROFILE))).network.hosts == 2


# -- names and specs ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [":", ".x:y", "a:", ":f", "a..b:f", "a:b:c", "charlm\n", "1a:f"])
def test_bad_workload_names(name):
    with pytest.raises(ConfigError, match=r"workload: must be one of charlm, digits or package.module:function"):
        check_workload_name(name)


def not_a_workload():
    return torch.nn.Linear(2, 2)


def failing_workload(path="/data/mine"):
    raise FileNotFoundError(f"no such folder: {path}")


def empty_validation():
    import thinwire

    data = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    return thinwire.Workload(model=torch.nn.Linear(2, 1), train=data, val=torch.utils.data.Subset(data, []),
                             loss=torch.nn.functional.mse_loss)


def iterable_training():
    import thinwire

    data = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    return thinwire.Workload(model=torch.nn.Linear(2, 1), train=iter(data), val=data, loss=torch.nn.functional.mse_loss)


def frozen_model():
    import thinwire

    data = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, 2))
    return thinwire.Workload(model=torch.nn.ReLU(), train=data, val=data, loss=torch.nn.functional.mse_loss)


def unpaired_items():
    import thinwire

    class Inputs(torch.utils.data.Dataset):  # items without targets
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(2)

    pairs = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    return thinwire.Workload(model=torch.nn.Linear(2, 1), train=Inputs(), val=pairs, loss=torch.nn.functional.mse_loss)


@pytest.mark.parametrize("name, options, match", [
    ("tests.test_inputs:empty_validation", {}, r"empty_validation's val set is empty; give it at least one item"),
    ("tests.test_inputs:frozen_model", {}, r"frozen_model's model has no trainable parameters"),
    ("tests.test_inputs:unpaired_items", {}, r"unpaired_items's train set gives a Tensor at train\[0\], where thinwire "
     r"needs an \(input, target\) pair"),
    ("tests.test_inputs:iterable_training", {}, r"iterable_training's train set has no len\(\); thinwire samples map"),
    ("tests.nowhere:f", {}, r"workload: cannot import module 'tests.nowhere'.*Check that it is on PYTHONPATH or in the current folder"),
    ("tests.test_inputs:nothing", {}, r"workload: module 'tests.test_inputs' has no function 'nothing'"),
    ("tests.test_inputs:failing_workload", {"size": 3}, r"model: options \['size'\] do not fit"),
    ("tests.test_inputs:not_a_workload", {}, r"must return a thinwire.Workload, got Linear"),
    ("tests.test_inputs:failing_workload", {"path": "/x"}, r"^workload: tests.test_inputs:failing_workload\(path='/x'\) raised "
     r"FileNotFoundError: no such folder: /x \(at .*test_inputs.py:\d+, in failing_workload\)"),
])
def test_a_user_workload_that_cannot_be_built_says_why_in_one_paragraph(name, options, match):
    from thinwire.workloads.registry import build_workload

    with pytest.raises(ThinwireError, match=match):
        build_workload(name, options, None)


@pytest.mark.parametrize("source, match", [
    ("def make(:\n", r"module 'tw_broken_workload' raised SyntaxError as it was imported: .* \(at .*tw_broken_workload.py:1\)"),
    ("raise RuntimeError('no GPU here')\n",
     r"module 'tw_broken_workload' raised RuntimeError as it was imported: 'no GPU here' \(at .*tw_broken_workload.py:1, "),
])
def test_a_user_workload_module_that_fails_as_it_loads_says_where_in_one_paragraph(tmp_path, monkeypatch, source, match):
    """Only ImportError was caught: a syntax error or an exception at import time was a traceback."""
    import sys

    from thinwire.workloads.registry import build_workload

    (tmp_path / "tw_broken_workload.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "tw_broken_workload", raising=False)
    with pytest.raises(ThinwireError, match=match):
        build_workload("tw_broken_workload:make", {}, None)


def test_a_user_workload_in_the_current_folder_is_found(tmp_path, monkeypatch):
    """`thinwire train --workload mywl:make` from the folder that holds mywl.py, as `python -m` would find it (it said
    "cannot import module 'mywl' ... Check that it is on PYTHONPATH"); the folder goes last on the path."""
    import sys

    from thinwire.workloads.registry import build_workload

    (tmp_path / "tw_cwd_workload.py").write_text(
        "import torch, thinwire\n"
        "def make():\n"
        "    pairs = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))\n"
        "    return thinwire.Workload(model=torch.nn.Linear(2, 1), train=pairs, val=pairs, "
        "loss=torch.nn.functional.mse_loss)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored afterwards
    monkeypatch.delitem(sys.modules, "tw_cwd_workload", raising=False)
    assert isinstance(build_workload("tw_cwd_workload:make", {}, None).model, torch.nn.Linear)
    assert sys.path[-1] == str(tmp_path) and sys.modules["tw_cwd_workload"].__file__.startswith(str(tmp_path))
    del sys.modules["tw_cwd_workload"]


@pytest.mark.parametrize("spec_text, match", [
    pytest.param("torch:powersgd:rank=²", r"compression: must be torch:powersgd:rank=R with an integer R in \[1, 4096\]",
                 id="peer-superscript"),
    pytest.param("torch:powersgd:rank=٣", r"compression: must be torch:powersgd:rank=R", id="peer-arabic-digit"),
])
def test_torch_peer_specs(spec_text, match):
    with pytest.raises(ConfigError, match=match):
        parse_comm_spec(spec_text)


@pytest.mark.parametrize("spec_text, match", [
    pytest.param("powersgd:rank=²", r"powersgd\.rank: must be an integer \(1\.\.1024\), got '²'", id="superscript"),
    pytest.param("powersgd:rank=٣", r"powersgd\.rank: must be an integer \(1\.\.1024\), got '٣'", id="arabic-digit"),
    pytest.param("topk:ratio=inf", r"topk\.ratio: must be a number \(0 < ratio <= 1\), got 'inf'", id="inf"),
    pytest.param("powersgd:rank=1e300", r"powersgd\.rank: must be an integer of 64 bits", id="huge"),
    pytest.param("int8:block=" + "9" * 5000, r"int8\.block: must be an integer \(8\.\.65536\), got '9{20}.*\(5002 characters\)",
                 id="digits"),
])
def test_codec_spec_values(spec_text, match):
    with pytest.raises(ConfigError, match=match):
        parse_codec_spec(spec_text)


# -- checkpoints ----------------------------------------------------------------------------------
class _Evil:
    def __reduce__(self):
        return (print, ("this ran",))


def test_checkpoint_without_signature(tmp_path):
    path = tmp_path / "step_000000001.pt"
    torch.save({"format": ckpt.FORMAT, "step": 1, "wall_s": 0.0, "model": {}, "optimizer": {}, "scheduler": {},
                "ranks": []}, path)
    with pytest.raises(ThinwireError, match=r"is incomplete: its entry 'signature' is missing.*\(no such entry\)"):
        ckpt.load(path)
    # the entries a resume reads inside them: a KeyError in every worker before
    full = {"format": ckpt.FORMAT, "step": 1, "wall_s": 0.0, "model": {}, "scheduler": {}, "ranks": [],
            "signature": {}, "config": {}, "optimizer": {"state": {}, "param_groups": []}}
    for drop, says in (("config", r"entry 'config' is missing.*\(no such entry\)"),
                       ("optimizer", r"entry 'optimizer.state' is missing.*\(no such entry\)")):
        torch.save({**full, drop: {}} if drop == "optimizer" else {k: v for k, v in full.items() if k != drop}, path)
        with pytest.raises(ThinwireError, match=says):
            ckpt.load(path)
    torch.save(full, path)
    assert ckpt.load(path)["step"] == 1


def test_a_damaged_or_foreign_checkpoint_is_refused_as_such(tmp_path):
    """torch.load reads a zip entry without its checksum: damaged numbers would load as other numbers."""
    path = tmp_path / "step_000000001.pt"
    torch.save({"format": ckpt.FORMAT, "step": 1, "wall_s": 0.0, "model": {"w": torch.ones(64)}, "optimizer": {},
                "scheduler": {}, "signature": {}, "ranks": []}, path)
    good = path.read_bytes()
    at = good.index(torch.ones(64).numpy().tobytes())  # the tensor's bytes, stored as they are
    path.write_bytes(good[:at] + b"\xff" * 16 + good[at + 16:])
    with pytest.raises(ThinwireError, match=r"is damaged: its entry '.*/data/0' does not match its checksum"):
        ckpt.load(path)
    assert path.read_bytes() != good  # left as it was
    for junk, match in ((b"garbage\n", r"is corrupt, truncated or not a checkpoint: it is not the zip archive"),
                        (b"\0\0\0\0" + good[4:], r"is damaged: its entry '.*data.pkl' does not match")):
        path.write_bytes(junk)
        with pytest.raises(ThinwireError, match=match):
            ckpt.load(path)


def test_malicious_pickle_is_reported_as_refused(tmp_path, capsys):
    path = tmp_path / "step_000000001.pt"
    torch.save({"format": ckpt.FORMAT, "x": _Evil()}, path)
    with pytest.raises(ThinwireError, match=r"was refused: it contains objects other than tensors"):
        ckpt.load(path)
    assert "this ran" not in capsys.readouterr().out


@pytest.mark.parametrize("make, match", [
    pytest.param(lambda: SimOptions(colocated_cores=float("nan")), r"--colocated: must be a number of cores in \(0, 4096\], got nan",
                 id="simulate-colocated-nan"),
    pytest.param(lambda: SimOptions(j_per_bit=float("inf")), r"--j-per-bit: must be joules per bit in \[0, 1\], got inf"
                 r".*The internet's is about 2.7e-05 \(Aslan",
                 id="simulate-j-per-bit-inf"),
    pytest.param(lambda: SimOptions(threads=10**9), r"--threads: must be an integer in \[1, 1024\]", id="simulate-threads"),
    pytest.param(lambda: PlanOptions(batch_size=8, max_error=float("inf")), r"--max-error: must be a relative error in \(0, ",
                 id="plan-max-error-inf"),
    pytest.param(lambda: PlanOptions(batch_size=8, eval_batches=-2), r"--eval-batches: must be an integer",
                 id="plan-eval-batches-negative"),
    pytest.param(lambda: PlanOptions(batch_size=8, colocated_cores=-1.0), r"--colocated: must be a number of cores in",
                 id="plan-colocated-negative"),
    pytest.param(lambda: profile_workload(workload="digits", batch_sizes=[4], bucket_mb=float("inf")),
                 r"--bucket-mb: must be a finite number in \(0, 4096\], got inf", id="profile-bucket-mb-inf"),
])
def test_number_flags_of_plan_simulate_and_profile_are_bounded(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


class _OneHeadUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.used(x)


def unused_head():
    """A user's model with a layer its forward never calls."""
    from thinwire.workloads.base import Workload

    g = torch.Generator().manual_seed(0)
    data = [(x, int(x.sum() > 0)) for x in torch.randn(128, 8, generator=g)]
    return Workload(model=_OneHeadUnused(), train=data, val=data, loss=torch.nn.functional.cross_entropy,
                    task="classification", batch_size=16, steps=4)


@pytest.mark.parametrize("sync", ["allreduce", "delayed", "local:period=2,warmup=0"])
def test_a_parameter_the_loss_does_not_use_is_named_not_a_ddp_traceback(tmp_path, sync):
    """DDP's error advises find_unused_parameters, which thinwire does not take: the parameters are named with
    the fix that applies. A mode that averages outside DDP's backward (its check off) says the same, where it
    trained on, averaging zeros for them (weight decay moved the unused layer)."""
    from tests.test_cli import thinwire

    proc = thinwire("train", "--workload", "tests.test_inputs:unused_head", "--nproc", "2", "--out", str(tmp_path / "r"),
                    "--sync", sync)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "model: spare.weight, spare.bias got no gradient in step 1: the loss does not depend on them" in proc.stderr
    assert "p.requires_grad_(False)" in proc.stderr


def takes_no_data():
    return empty_validation()


def bad_task():
    import dataclasses

    return dataclasses.replace(unpaired_items(), task="foo")


not_callable = 3


@pytest.mark.parametrize("name, data, match", [
    ("tests.test_inputs:takes_no_data", "/tmp", r"data: tests.test_inputs:takes_no_data takes no data argument, so "
     r"--data '/tmp' would go unused"),
    ("tests.test_inputs:bad_task", None, r"bad_task's Workload has task='foo'; it must be lm, classification or regression"),
    ("tests.test_inputs:not_callable", None, r"module 'tests.test_inputs' has 'not_callable' of type int, not a function"),
])
def test_a_user_workload_drops_no_input_in_silence(name, data, match):
    from thinwire.workloads.registry import build_workload

    with pytest.raises(ThinwireError, match=match):
        build_workload(name, {}, data)


def wrong_shape_model():
    import thinwire

    data = torch.utils.data.TensorDataset(torch.zeros(16, 8), torch.zeros(16, dtype=torch.long))
    return thinwire.Workload(model=torch.nn.Linear(5, 3), train=data, val=data, loss=torch.nn.functional.cross_entropy,
                             batch_size=8, task="classification")


def wrong_loss():
    import thinwire

    data = torch.utils.data.TensorDataset(torch.zeros(16, 8), torch.zeros(16, dtype=torch.long))
    return thinwire.Workload(model=torch.nn.Linear(8, 3), train=data, val=data, loss=lambda o, y: o.view(5, -1).sum(),
                             batch_size=8, task="classification")


def per_item_loss():
    import thinwire

    data = torch.utils.data.TensorDataset(torch.zeros(16, 8), torch.zeros(16, dtype=torch.long))
    return thinwire.Workload(model=torch.nn.Linear(8, 3), train=data, val=data,
                             loss=torch.nn.CrossEntropyLoss(reduction="none"), batch_size=8, task="classification")


def wrong_validation():
    import thinwire

    data = torch.utils.data.TensorDataset(torch.zeros(16, 8), torch.zeros(16, dtype=torch.long))
    val = torch.utils.data.TensorDataset(torch.zeros(16, 5), torch.zeros(16, dtype=torch.long))
    return thinwire.Workload(model=torch.nn.Linear(8, 3), train=data, val=val, loss=torch.nn.functional.cross_entropy,
                             batch_size=8, task="classification")


class _Corrupt(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 37:
            raise ValueError(f"record {i} is corrupt")
        return torch.ones(8) * i / 64, torch.tensor(i % 3)


def corrupt_item():
    import thinwire

    return thinwire.Workload(model=torch.nn.Linear(8, 3), train=_Corrupt(), val=wrong_loss().train,
                             loss=torch.nn.functional.cross_entropy, batch_size=8, task="classification", steps=12)


@pytest.mark.parametrize("name, says", [
    # the validation set was first used at the first validation: a traceback, every step before it lost
    ("wrong_validation", r"wrong_validation's validation set does not fit its model or loss \(its first item: "
                         r"RuntimeError: mat1 and mat2 shapes cannot be multiplied .*Nothing was trained"),
    ("per_item_loss", r"per_item_loss's loss returned a tensor of shape \(\d,\) \(float32\); it must return one "
                      r"floating-point tensor for the batch, the mean over its items"),
    ("wrong_shape_model", r"wrong_shape_model's model's forward failed on the first batch \(inputs of shape \(\d, 8\), "
                          r"targets \(\d,\)\): RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("wrong_loss", r"wrong_loss's loss failed on the first batch \(the model's output of shape \(\d, 3\), targets \(\d,\)\): "
                   r"RuntimeError: .*\(at .*test_inputs.py:\d+, in <lambda>\)"),
])
def test_a_workload_that_fails_on_its_first_batch_says_so_and_leaves_no_run(tmp_path, name, says):
    import re

    from tests.test_cli import thinwire

    for nproc in ("1", "2"):
        out = tmp_path / f"run{nproc}"
        r = thinwire("train", "--workload", f"tests.test_inputs:{name}", "--steps", "3", "--nproc", nproc,
                     "--out", str(out), timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert re.search(says, " ".join(r.stderr.split())), r.stderr[-3000:]
        assert not out.exists()


def test_a_training_item_the_dataset_cannot_give_is_named_with_its_step_and_the_run_is_kept(tmp_path):
    """A corrupt record in the middle of a run: every rank's traceback; now one paragraph naming the item, the
    step and the user's line, and the run's checkpoints stay for a --resume."""
    import re

    from tests.test_cli import thinwire

    out = tmp_path / "run"
    r = thinwire("train", "--workload", "tests.test_inputs:corrupt_item", "--checkpoint-every", "1", "--out", str(out),
                 timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    said = " ".join(r.stderr.split())
    assert re.search(r"corrupt_item's training set failed to give item 37 at step \d+: ValueError: record 37 is "
                     r"corrupt \(at .*test_inputs.py:\d+, in __getitem__\)\. The run's checkpoints are kept", said), said
    assert list((out / "checkpoints").glob("step_*.pt"))


def exits_on_import():
    raise SystemExit(3)


def numpy_split(steps=200):
    import numpy as np

    import thinwire

    order = np.random.permutation(40)  # as scikit-learn's train_test_split does without a random_state
    x, y = torch.arange(40.0).view(40, 1), torch.zeros(40, dtype=torch.long)
    data = torch.utils.data.TensorDataset(x[order[:30]], y[order[:30]])
    return thinwire.Workload(model=torch.nn.Linear(1, 2), train=data, val=data, steps=steps,
                             loss=torch.nn.functional.cross_entropy, task="classification")


def test_a_user_workload_that_exits_draws_from_numpy_or_suggests_bad_defaults_is_handled():
    """A workload whose function exits gave no message; one that split its data with NumPy's global generator got
    another split in every process (ranks trained on each other's validation items); steps=0 ran an empty run."""
    from thinwire.workloads.registry import build_workload

    with pytest.raises(ThinwireError, match=r"exits_on_import exited \(SystemExit 3\) instead of returning"):
        build_workload("tests.test_inputs:exits_on_import", {}, None)
    splits = []
    for _ in range(2):
        torch.manual_seed(7)
        np_state = __import__("numpy").random.rand()  # whatever the global generator held before
        splits.append(build_workload("tests.test_inputs:numpy_split", {}, None).train.tensors[0].flatten().tolist())
        assert np_state is not None
    assert splits[0] == splits[1]
    for bad in (0, -1, 2.5):
        with pytest.raises(ThinwireError, match=rf"numpy_split's Workload has steps={bad}; it must be an integer >= 1"):
            build_workload("tests.test_inputs:numpy_split", {"steps": bad}, None)


def test_a_memory_budget_below_the_models_parameters_is_refused_before_the_workers(tmp_path):
    """`--memory-budget 1KiB` was refused by every worker at start-up, and again at each of --max-restarts'
    restarts (the paragraph six times); it is refused once, before anything starts."""
    import subprocess
    import sys

    from tests.test_cli import ROOT

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "digits", "--nproc", "2",
                        "--max-restarts", "2", "--memory-budget", "1KiB", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr.count("memory_budget: must be at least") == 1, r.stderr[-2000:]
    assert "restart" not in r.stderr and not out.exists()


def test_an_empty_config_file_is_refused(tmp_path):
    """A blank (or cut) --config file ran the default job, minutes long, without a word."""
    from thinwire.errors import ConfigError
    from thinwire.train.config import load_train_config

    empty = tmp_path / "run.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"config file '.*run.yaml': must be a mapping of field: value, got 'a file "
                                          r"without fields'"):
        load_train_config(str(empty), {}, [])


@pytest.mark.parametrize("text, field", [("colour: red\n", "colour"), ('compression: "int8:bitz=4"\n', "int8 parameter")])
def test_an_unknown_key_or_codec_parameter_in_a_config_file_names_the_file(tmp_path, text, field):
    """An unknown top-level key or a codec's unknown parameter in the file named neither the file nor where."""
    from thinwire.errors import ConfigError
    from thinwire.train.config import load_train_config

    path = tmp_path / "run.yaml"
    path.write_text("workload: digits\n" + text)
    with pytest.raises(ConfigError, match=rf"^{field}: must be .*It is in config file '.*run.yaml'"):
        load_train_config(str(path), {}, [])


def test_a_piped_table_is_not_cut_to_80_columns():
    """`thinwire simulate | tee log` cut its table's numbers to ellipses (0.1… for 0.183)."""
    from thinwire.cli.common import wide_console

    assert wide_console().width == 200  # pytest's stdout is no terminal
