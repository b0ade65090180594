"""``--partition``: each rank's own shard of the training set (iid, a Dirichlet class skew, contiguous
runs), deterministic and disjoint; refused where it cannot apply; a resume stays bit-identical."""

from __future__ import annotations

import collections

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.workloads.partition import ShardSampler, dirichlet_split, parse_partition, shards


def test_forms_and_refusals():
    assert parse_partition("iid").kind == "iid" and parse_partition("BY_FILE").kind == "by_file"
    assert parse_partition("label_skew:alpha=0.5").alpha == 0.5
    assert parse_partition("label_skew:alpha=0.5").text == "label_skew:alpha=0.5"
    for bad in ("random", "label_skew", "label_skew:alpha=0", "label_skew:alpha=-1", "label_skew:beta=1",
                "label_skew:alpha=x", "iid:alpha=1"):
        with pytest.raises(ConfigError, match="partition"):
            parse_partition(bad)


def _labels(n_per_class: int = 100, classes: int = 10) -> torch.Tensor:
    return torch.arange(classes).repeat_interleave(n_per_class)


def _max_class_share(shard: list[int], labels: torch.Tensor) -> float:
    counts = collections.Counter(labels[shard].tolist())
    return max(counts.values()) / len(shard)


def test_dirichlet_split_is_a_deterministic_partition_whose_skew_follows_alpha():
    labels = _labels()
    for alpha in (0.1, 1000.0):
        a = dirichlet_split(labels, 4, alpha, seed=3)
        assert a == dirichlet_split(labels, 4, alpha, seed=3)  # a pure function of its arguments
        flat = sorted(i for s in a for i in s)
        assert flat == list(range(len(labels)))                  # disjoint, and every item somewhere
    skewed = [_max_class_share(s, labels) for s in dirichlet_split(labels, 4, 0.1, seed=0)]
    even = [_max_class_share(s, labels) for s in dirichlet_split(labels, 4, 1000.0, seed=0)]
    assert sum(skewed) / 4 > 0.25 and max(even) < 0.15  # iid: about 0.1 (10 classes)
    assert dirichlet_split(labels, 4, 0.1, seed=0) != dirichlet_split(labels, 4, 0.1, seed=1)


def test_by_file_gives_contiguous_runs_and_samplers_stay_in_their_shard():
    data = list(range(103))
    runs = shards(parse_partition("by_file"), data, 4, seed=0)
    assert [r[0] for r in runs] == [0, 25, 51, 77] and sum(len(r) for r in runs) == 103
    assert all(r == list(range(r[0], r[-1] + 1)) for r in runs)
    s = ShardSampler(runs[2], seed=0, rank=2)
    drawn = [i for step in range(10) for i in s.indices(step, 8)]
    assert set(drawn) <= set(runs[2]) and drawn == [i for step in range(10) for i in ShardSampler(runs[2], 0, 2).indices(step, 8)]


def test_one_hot_or_soft_targets_have_classes_for_the_skew_and_for_accuracy():
    """A classification workload with one-hot targets (or label smoothing's probabilities) crashed the skew
    ("only one element tensors can be converted") and validation's accuracy (a shape mismatch)."""
    from torch.utils.data import TensorDataset

    from thinwire.errors import ThinwireError
    from thinwire.workloads.base import correct
    from thinwire.workloads.partition import labels_of

    classes = torch.tensor([2, 0, 1, 2])
    soft = torch.nn.functional.one_hot(classes, 3).float() * 0.9 + 0.1 / 3
    assert labels_of(TensorDataset(torch.zeros(4, 2), soft)).tolist() == classes.tolist()
    out = torch.tensor([[0.0, 0, 1], [1, 0, 0], [0, 0, 1], [0, 0, 1]])
    assert correct(out, classes) == correct(out, soft) == 3.0
    with pytest.raises(ThinwireError, match=r"class indices \(shape \(4,\) for outputs of shape \(4, 3\)\).*"
                                            r"these targets are \(4, 2\). Give the Workload task='regression'"):
        correct(out, torch.zeros(4, 2))
    # one output per item: a binary classifier's logit (or probability), not an argmax over one column (always 0)
    logits, labels = torch.tensor([[3.0], [-2.0], [0.4], [-0.1]]), torch.tensor([[1.0], [1.0], [0.0], [0.0]])
    assert correct(logits, labels) == correct(logits.squeeze(1), labels.squeeze(1).long()) == 2.0
    assert correct(torch.sigmoid(logits), labels) == 2.0
    with pytest.raises(ThinwireError, match=r"one output per item is a binary classifier, whose targets are 0 and 1; "
                                            r"these lie in \[-1\.5, 2\]\. Give the Workload task='regression'"):
        correct(logits, torch.tensor([[2.0], [-1.5], [0.0], [0.3]]))
    with pytest.raises(ThinwireError, match=r"partition: label_skew needs each item's class.*shape \(2, 2\)"):
        labels_of(TensorDataset(torch.zeros(4, 2), torch.zeros(4, 2, 2)))


def test_by_file_with_fewer_items_than_ranks_is_refused_before_anything_starts():
    """Each worker failed on its empty shard ("got 'shard'"), and --max-restarts tried again."""
    with pytest.raises(ConfigError, match=r"partition: must be at least one training item per rank \(3 items for 4 "
                                          r"ranks\), got 'by_file'"):
        shards(parse_partition("by_file"), list(range(3)), 4, seed=0)


def test_label_skew_needs_classes():
    with pytest.raises(ConfigError, match="partition.*label_skew.*by_file"):
        shards(parse_partition("label_skew:alpha=1"), list(range(10)), 2, seed=0, task="lm")


@pytest.mark.slow
def test_trainer_with_label_skew_resumes_bit_identically_and_charlm_refuses_it(tmp_path):
    from tests.test_cli import assert_refused, thinwire as cli
    from tests.test_sync import _assert_equal, _straight_and_resumed

    common = ["--workload", "digits", "--nproc", "2", "--partition", "label_skew:alpha=0.3", "--eval-every", "5"]
    a, b = _straight_and_resumed(common, tmp_path / "straight", tmp_path / "split")
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    _assert_equal(a.get("ranks"), b.get("ranks"))
    assert_refused(cli("train", "--workload", "charlm", "--partition", "label_skew:alpha=1", "--steps", "2",
                       "--out", str(tmp_path / "lm")), r"partition: must be iid or by_file")
    assert not (tmp_path / "lm").exists()


def test_digits_drift_changes_training_and_validation_data_from_its_step():
    from thinwire.workloads.registry import build_workload

    wl = build_workload("digits", {"drift_step": 5}, None)
    before, after = wl.data_at(4), wl.data_at(5)
    assert before == (wl.train, wl.val)
    assert torch.equal(after[0].x, wl.train.x) and torch.equal(after[0].y, (wl.train.y + 1) % 10)
    assert torch.equal(after[1].y, (wl.val.y + 1) % 10)
    mirrored = build_workload("digits", {"drift_step": 5, "drift": "inputs"}, None).data_at(9)
    assert torch.equal(mirrored[0].x, wl.train.x.flip(-1)) and torch.equal(mirrored[0].y, wl.train.y)
    assert build_workload("digits", {}, None).data_at is None
    with pytest.raises(ConfigError, match="model.drift"):
        build_workload("digits", {"drift": "colors"}, None)


def test_charlm_drift_switches_to_a_corpus_of_the_same_length():
    from thinwire.workloads.registry import build_workload

    opts = {"max_bytes": 200_000, "context": 16, "layers": 1, "width": 32}
    wl = build_workload("charlm", {**opts, "drift_step": 7}, None)
    before, (train, val) = wl.data_at(6), wl.data_at(7)
    assert before == (wl.train, wl.val) and len(train) == len(wl.train) and len(val) == len(wl.val)
    x0, _ = wl.train.batch([100])
    x1, _ = train.batch([100])
    text0, text1 = bytes(x0[0].tolist()), bytes(x1[0].tolist())
    import codecs

    assert text1 == codecs.encode(text0.decode("latin-1"), "rot13").encode("latin-1") and text0 != text1
    swapped = build_workload("charlm", {**opts, "drift_step": 3, "drift": "swapcase"}, None).data_at(3)[1]
    xv, _ = wl.val.batch([5])
    assert bytes(swapped.batch([5])[0][0].tolist()) == bytes(xv[0].tolist()).swapcase()
    assert build_workload("charlm", opts, None).data_at is None
    with pytest.raises(ConfigError, match="model.drift.*rot13 or swapcase"):
        build_workload("charlm", {**opts, "drift": "french"}, None)


def test_by_file_on_a_corpus_of_fewer_files_than_workers_says_so(tmp_path):
    """The cuts fall at equal shares of the corpus, not at file boundaries: with one file, two workers train on
    parts of it, and the trainer says so rather than letting "by_file" promise a file each."""
    from tests.test_cli import thinwire as cli

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world " * 400)
    proc = cli("train", "--data", str(tmp_path / "corpus"), "--nproc", "2", "--partition", "by_file", "--steps", "1",
               "--set", "model.layers=1", "--set", "model.width=16", "--set", "model.context=16",
               "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the corpus has 1 file(s) for 2 workers, so some workers train on parts of the same file" in proc.stderr
