"""What a workload hands to the trainer, and how data is cut into per-rank batches.

A workload is a model, a training set, a validation set and a loss. thinwire's own workloads
(``charlm``, ``digits``) and a user's (``--workload package.module:function``) return the same
:class:`Workload`, so the trainer never knows whose code it runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Callable, Literal, Protocol

import torch
from torch import Tensor, nn

from thinwire.errors import ThinwireError


class SizedDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...


@dataclasses.dataclass(kw_only=True)
class Workload:
    """A model with its data and loss.

    ``loss(output, target) -> scalar mean`` is applied to ``model(inputs)``. Datasets are
    map-style (``len`` and ``[i] -> (input, target)``), an input a tensor or a dict, list or tuple of
    tensors (:mod:`thinwire.batch`: each is moved, cut into micro-batches and counted); a dataset may offer
    ``batch(indices)`` returning ``(inputs, targets)`` directly, which is faster than collating items one
    by one.
    ``task`` decides the validation metrics: ``lm`` adds bits per byte, ``classification`` adds
    accuracy. ``info`` goes into ``summary.json`` as it is (e.g. the corpus's unigram entropy).
    ``lr``/``batch_size``/``steps`` are the workload's suggested defaults. ``data_at(step)``, if given,
    returns the (train, val) sets in force at a step (a concept-drift workload); item indices keep
    their meaning across the drift, so shards and samplers are unchanged. ``layers(model)`` lists the
    model's layers for ``--pipeline`` (:mod:`thinwire.pipeline.stages`).
    """

    model: nn.Module
    train: SizedDataset
    val: SizedDataset
    loss: Callable[[Tensor, Tensor], Tensor]
    task: Literal["lm", "classification", "regression"] = "regression"
    info: dict = dataclasses.field(default_factory=dict)
    lr: float = 1e-3
    batch_size: int = 32
    steps: int = 200
    data_at: Callable[[int], tuple[SizedDataset, SizedDataset]] | None = None  # a drifting workload's sets at a step
    # the model as a list of (name, module) in forward order, each taking the previous one's output: where
    # ``--pipeline`` may cut it into stages (None: an nn.Sequential's children, else no pipelining)
    layers: Callable[[nn.Module], list[tuple[str, nn.Module]]] | None = None


def correct(out: Tensor, y: Tensor) -> float:
    """Items of a classification batch whose largest output is their class: targets are class indices
    (``out``'s shape less its last dimension) or one-hot / class probabilities (``out``'s shape: the class
    is their largest entry, as with label smoothing or mixup). One output per item is a binary classifier's:
    class 1 where it exceeds 0 (a logit, as ``BCEWithLogitsLoss`` takes it), or 0.5 where every output of the
    batch lies in [0, 1] (a probability, after a sigmoid), against targets of 0 and 1 (or soft ones in [0, 1],
    the class where > 0.5).

    >>> correct(torch.tensor([[2.0], [-1.0], [0.5]]), torch.tensor([[1.0], [1.0], [0.0]]))  # logits
    1.0
    >>> correct(torch.tensor([0.9, 0.2, 0.6]), torch.tensor([1, 0, 0]))  # probabilities
    2.0
    """
    if torch.is_tensor(y) and (out.ndim == 1 or out.shape[-1] == 1) and y.numel() == out.numel():
        return _binary_correct(out.reshape(-1), y.reshape(-1))
    if torch.is_tensor(y) and y.is_floating_point() and y.shape == out.shape:
        y = y.argmax(-1)
    if not torch.is_tensor(y) or y.shape != out.shape[:-1]:
        shape = tuple(y.shape) if torch.is_tensor(y) else type(y).__name__
        raise ThinwireError(f"workload: task 'classification' reports accuracy from targets that are class indices "
                            f"(shape {tuple(out.shape[:-1])} for outputs of shape {tuple(out.shape)}) or class "
                            f"probabilities (the outputs' shape); these targets are {shape}. Give the Workload "
                            "task='regression' to report the loss only.")
    return float((out.argmax(-1) == y).sum())


def _binary_correct(out: Tensor, y: Tensor) -> float:
    y = y.float()
    if bool(((y < 0) | (y > 1)).any()):
        raise ThinwireError(f"workload: task 'classification' with one output per item is a binary classifier, whose "
                            f"targets are 0 and 1; these lie in [{float(y.min()):g}, {float(y.max()):g}]. Give the "
                            "Workload task='regression' to report the loss only, or two outputs per item for two "
                            "classes.")
    threshold = 0.5 if bool(((out >= 0) & (out <= 1)).all()) else 0.0
    return float(((out.float() > threshold) == (y > 0.5)).sum())


def class_of(target) -> int:
    """One item's class: an integer target, or the largest entry of a one-hot / probability vector."""
    t = torch.as_tensor(target)
    if t.numel() == 1:
        return int(t)
    if t.ndim == 1 and t.is_floating_point():
        return int(t.argmax())
    raise ThinwireError(f"partition: label_skew needs each item's class: an integer or a vector of class "
                        f"probabilities, got a target of shape {tuple(t.shape)}. Use --partition by_file (or iid).")


def collate(dataset: SizedDataset, indices: list[int]) -> tuple[Tensor, Tensor]:
    """Inputs and targets for ``indices``, through ``dataset.batch`` when it has one."""
    if hasattr(dataset, "batch"):
        return dataset.batch(indices)
    return torch.utils.data.default_collate([dataset[i] for i in indices])


def eval_subset(n: int, batches: int, global_batch: int) -> list[int]:
    """The validation items every evaluation uses: ``batches`` global batches' worth, evenly spaced over
    the ``n`` items (all of them when ``batches`` is 0 or they are fewer). A pure function of its
    arguments, so the subset is the same at every evaluation, after a restart and at any world size
    (each rank takes every ``world``-th item of it). Evenly spaced rather than the first ones: a
    validation set cut from consecutive files or classes would otherwise be judged by its head.

    >>> eval_subset(10, 1, 4), eval_subset(3, 1, 4)
    ([0, 3, 6, 9], [0, 1, 2])
    """
    want = n if batches == 0 else min(n, batches * global_batch)
    if want >= n:
        return list(range(n))
    return [round(i * (n - 1) / (want - 1)) for i in range(want)] if want > 1 else [0]


def eval_part(n: int, shares: Sequence[int], rank: int) -> range:
    """Positions in a validation subset of ``n`` items that ``rank`` forwards, ``shares`` the items per forward
    of every rank (their training shares). Equal shares: every p-th item from ``rank`` on. Unequal ones (a plan's
    balanced shares): a contiguous run proportional to the rank's share, so every rank forwards about as many
    chunks and a slow host given a small share validates few items (an equal split had a host with share 1
    forward its 1/p of the items one at a time while the others waited).

    >>> eval_part(10, [2, 2], 1), eval_part(10, [3, 1], 0), eval_part(10, [3, 1], 1)
    (range(1, 10, 2), range(0, 8), range(8, 10))
    """
    if len(set(shares)) <= 1:
        return range(rank, n, len(shares))
    total, before = sum(shares), sum(shares[:rank])
    return range(round(n * before / total), round(n * (before + shares[rank]) / total))


class GlobalSampler:
    """Indices of the global batch at step ``s``: a pure function of (seed, step), never of history.

    Because the batch depends only on the step number, a resumed or restarted run sees exactly the
    batches the uninterrupted run would have, whatever the world size. Small datasets are walked in
    epochs of a seeded permutation (sampling without replacement); datasets of more than
    ``2**20`` items (e.g. every window of a text corpus) are sampled uniformly with replacement,
    which avoids holding a permutation of millions of indices.
    """

    LARGE = 2**20

    def __init__(self, n: int, global_batch: int, seed: int) -> None:
        assert n > 0 and global_batch > 0
        self.n, self.batch, self.seed = n, global_batch, seed
        self._epoch, self._perm = -1, None

    def global_indices(self, step: int) -> list[int]:
        if self.n >= self.LARGE:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            return torch.randint(0, self.n, (self.batch,), generator=g).tolist()
        start = step * self.batch
        out: list[int] = []
        while len(out) < self.batch:
            epoch, offset = divmod(start + len(out), self.n)
            perm = self._permutation(epoch)
            out.extend(perm[offset : offset + self.batch - len(out)])
        return out

    def rank_indices(self, step: int, rank: int, shares: list[int]) -> list[int]:
        """This rank's slice of the global batch; ``shares`` are per-rank batch sizes summing to it."""
        start = sum(shares[:rank])
        return self.global_indices(step)[start : start + shares[rank]]

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g).tolist()
        return self._perm


def even_shares(global_batch: int, world: int) -> list[int]:
    """Equal per-rank batch sizes; the caller has checked divisibility."""
    return [global_batch // world] * world


def bits_per_byte(loss_nats: float) -> float:
    return loss_nats / math.log(2)
