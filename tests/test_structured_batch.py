"""A workload whose items are dicts (or tuples) of tensors, as a model taking several inputs has them
(``{"input_ids": ..., "attention_mask": ...}``): ``thinwire train`` moved ``x.to(device)`` and died with
"'dict' object has no attribute 'to'" in every worker. Now every tensor of a batch is moved, cut into
micro-batches and counted; a pipeline hands the schedule the batch's tensors and its first stage puts the
batch back together (``torch.distributed.pipelining`` takes tensors only)."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import thinwire
from tests.test_cli import thinwire as run_thinwire
from thinwire import batch as B
from thinwire.errors import ThinwireError


def _data(n=600):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return x, x[:, :4].sum(1, keepdim=True)


class Pairs(Dataset):
    """Items ``({"a": first half, "b": second half}, target)``."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"a": self.x[i, :8], "b": self.x[i, 8:]}, self.y[i]


class FromDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 16)

    def forward(self, d):
        return torch.cat([self.a(d["a"]), self.b(d["b"])], 1)


class FromTensor(FromDict):
    def forward(self, x):
        return super().forward({"a": x[:, :8], "b": x[:, 8:]})


def _workload(first, dataset):
    torch.manual_seed(0)
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = _data()
    return thinwire.Workload(model=model, train=dataset(x[:500], y[:500]), val=dataset(x[500:], y[500:]),
                             loss=nn.functional.mse_loss, lr=3e-3, batch_size=16, steps=12)


def dict_workload():
    return _workload(FromDict(), Pairs)


def tensor_workload():
    """The same model and data with one tensor per item: what the dict workload must compute."""
    return _workload(FromTensor(), TensorDataset)


def test_every_tensor_of_a_batch_is_moved_cut_and_counted():
    Pt = collections.namedtuple("Pt", "u v")
    x = {"a": torch.arange(6.0).view(3, 2), "b": [torch.arange(3), "tag"], "c": Pt(torch.zeros(3, 1), 7)}
    assert B.batch_len(x) == 3
    parts = B.split(x, [2, 1])
    assert [B.batch_len(p) for p in parts] == [2, 1]
    assert torch.equal(parts[1]["a"], x["a"][2:]) and parts[1]["b"][1] == "tag" and parts[1]["c"].v == 7
    assert isinstance(parts[0]["c"], Pt) and [B.batch_len(p) for p in B.tensor_split(x, 2)] == [2, 1]
    assert B.rebuild(x, [t + 1 for t in B.tensors(x)])["b"][0].tolist() == [1, 2, 3]
    assert torch.equal(B.split(torch.arange(5), [3, 2])[1], torch.tensor([3, 4]))


@pytest.mark.parametrize("bad, found", [({"a": torch.zeros(3, 2), "b": torch.zeros(4)}, r"first dimensions \[3, 4\]"),
                                        (["text"], "no tensor"), (torch.tensor(1.0), "0-d")])
def test_a_batch_without_one_first_dimension_is_refused_with_what_it_has(bad, found):
    with pytest.raises(ThinwireError, match=f"workload: a batch must be.*{found}"):
        B.batch_len(bad)


def test_layers_of_a_dict_model_are_measured_for_the_planner():
    from thinwire.measure.layers import measure_layers
    from thinwire.pipeline.stages import layer_list

    wl = dict_workload()
    records = measure_layers(wl, layer_list(wl.model, None), 8, reps=1, warmup=0)
    assert [r.parameters for r in records] == [2 * (8 * 16 + 16), 0, 32 * 32 + 32, 0, 33]
    assert records[0].output_bytes == 32 * 4 and all(r.backward_s > 0 for r in records)


def _val_losses(out):
    return [json.loads(line)["val_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "val_loss" in line]


@pytest.mark.slow
def test_a_dict_batch_trains_as_its_tensor_twin_on_2_workers_in_micro_batches_and_in_a_pipeline(tmp_path):
    common = ["--steps", "12", "--eval-every", "6", "--checkpoint-every", "12", "--set", "eval_batches=0"]
    runs = {"tensor": ["--workload", "tests.test_structured_batch:tensor_workload"],
            "dict": ["--workload", "tests.test_structured_batch:dict_workload", "--nproc", "2",
                     "--memory-budget", "1MiB"],  # the memory plan measures a step on the dict batch too
            "pipeline": ["--workload", "tests.test_structured_batch:dict_workload", "--nproc", "2",
                         "--pipeline", "gpipe:stages=2"]}
    for name, args in runs.items():
        r = run_thinwire("train", *args, *common, "--out", str(tmp_path / name))
        assert r.returncode == 0, (name, r.stderr[-3000:])
    # in micro-batches: a budget that fits 8 of the 16 samples, from the memory plan's own fit of the dict run
    fit = json.loads((tmp_path / "dict" / "summary.json").read_text())["precision_report"]["memory_plan"]["fit_bytes"]
    budget = fit["fixed"] + 8 * fit["per_sample"] + fit["per_sample"] // 2
    r = run_thinwire("train", "--workload", "tests.test_structured_batch:dict_workload", "--memory-budget", f"{budget}B",
                     *common, "--out", str(tmp_path / "micro"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "micro" / "summary.json").read_text())["precision_report"]["micro_sizes"] == [8, 8]
    want = torch.tensor(_val_losses(tmp_path / "tensor"))
    assert len(want) == 2
    for name in ("dict", "pipeline", "micro"):
        torch.testing.assert_close(torch.tensor(_val_losses(tmp_path / name)), want, rtol=1e-5, atol=0, msg=name)


class TwoHeads(nn.Module):
    """A last layer with two outputs, as a model with an auxiliary head has."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 1)

    def forward(self, x):
        o = self.l(x)
        return o, 0.5 * o


def two_output_workload():
    torch.manual_seed(0)
    x, y = _data()
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), TwoHeads())
    return thinwire.Workload(model=model, train=TensorDataset(x[:500], y[:500]), val=TensorDataset(x[500:590], y[500:590]),
                             loss=lambda o, t: nn.functional.mse_loss(o[0], t) + 0.1 * nn.functional.mse_loss(o[1], t),
                             lr=3e-3, batch_size=16, steps=4)


@pytest.mark.slow
def test_a_model_with_a_tuple_output_validates_in_a_pipeline_as_in_one_process(tmp_path):
    """90 validation items in batches of 16: the last batch is padded to the schedule's shape, and the padding
    dropped from every tensor of the output, not from the tuple."""
    common = ["--workload", "tests.test_structured_batch:two_output_workload", "--steps", "4", "--eval-every", "2",
              "--set", "eval_batches=0"]
    for name, args in {"one": [], "pipeline": ["--nproc", "2", "--pipeline", "gpipe"]}.items():
        r = run_thinwire("train", *common, *args, "--out", str(tmp_path / name))
        assert r.returncode == 0, (name, r.stderr[-3000:])
    want = torch.tensor(_val_losses(tmp_path / "one"))
    assert len(want) == 2
    torch.testing.assert_close(torch.tensor(_val_losses(tmp_path / "pipeline")), want, rtol=1e-5, atol=0)
