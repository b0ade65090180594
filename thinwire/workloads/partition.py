"""Which training items each rank draws from: ``--partition`` (config key ``partition``).

* ``iid`` (the default): every rank takes its slice of one global batch drawn from the whole training
  set (:class:`~thinwire.workloads.base.GlobalSampler`), as DDP's ``DistributedSampler`` does.
* ``label_skew:alpha=A``: each rank owns a shard with skewed classes, the Dirichlet split of Hsu et
  al. 2019 (https://arxiv.org/abs/1909.06335) used throughout federated learning: for every class,
  proportions over the ranks are drawn from ``Dir(A)`` and the class's items are cut accordingly.
  Small A (0.1) gives each rank a few classes, large A (100) approaches iid. Classification only.
* ``by_file``: each rank owns a contiguous run of the training set, an equal share of its items. For
  charlm, whose corpus is its files concatenated in order, each rank's run covers other files (other
  modules, other styles); the cuts fall at equal shares, not at file boundaries, so neighbouring ranks may
  share a file's parts, and with fewer files than ranks some ranks hold parts of one file (the trainer
  says so). For other workloads: whatever order the dataset has.

A rank then draws its batch from its own shard only (a seeded walk over the shard, or uniform draws
with replacement for shards of more than 2^20 items). Shards and draws are pure functions of (the
training set, the world size, the seed, the step), so a resume sees exactly the batches the
uninterrupted run would have, and a run restarted at another world size re-splits deterministically.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from thinwire.errors import ConfigError
from thinwire.workloads.base import GlobalSampler, class_of

KINDS = ("iid", "label_skew", "by_file")
_FIX = "E.g. iid, label_skew:alpha=0.5, by_file"


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    kind: str = "iid"
    alpha: float = 0.0

    @property
    def text(self) -> str:
        return f"label_skew:alpha={self.alpha:g}" if self.kind == "label_skew" else self.kind


def parse_partition(text: str) -> PartitionSpec:
    """``iid``, ``label_skew:alpha=A`` (A > 0) or ``by_file``; a mistake names the value and the forms."""
    if not isinstance(text, str):
        raise ConfigError("partition", text, "one of " + ", ".join(KINDS), _FIX)
    head, _, rest = text.strip().partition(":")
    kind = head.strip().lower()
    if kind not in KINDS:
        raise ConfigError("partition", text, "one of " + ", ".join(KINDS), _FIX)
    if kind != "label_skew":
        if rest.strip():
            raise ConfigError("partition", text, f"{kind} without parameters", _FIX)
        return PartitionSpec(kind)
    key, sep, raw = (t.strip() for t in rest.partition("="))
    try:
        alpha = float(raw) if key == "alpha" and sep else float("nan")
    except ValueError:
        alpha = float("nan")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ConfigError("partition", text, "label_skew:alpha=A with a number A > 0",
                          "0.1 gives each rank a few classes, 100 is close to iid.")
    return PartitionSpec("label_skew", alpha)


def labels_of(dataset) -> torch.Tensor:
    """Every training item's class: the dataset's ``targets``/``y`` tensor, else item by item."""
    for name in ("targets", "y"):
        t = getattr(dataset, name, None)
        if isinstance(t, torch.Tensor) and t.ndim == 1 and len(t) == len(dataset):
            return t.long()
    return torch.tensor([class_of(dataset[i][1]) for i in range(len(dataset))])


def shards(spec: PartitionSpec, dataset, world: int, seed: int, task: str = "classification") -> list[list[int]]:
    """Each rank's training items (disjoint, together every item); ``iid`` is not sharded."""
    n = len(dataset)
    if spec.kind == "by_file":
        if n < world:  # a rank without items: refused here, before anything starts
            raise ConfigError("partition", spec.text, f"at least one training item per rank ({n} items for {world} "
                              "ranks)", "Use fewer ranks, or give the workload at least as many training items.")
        return [list(range(r * n // world, (r + 1) * n // world)) for r in range(world)]
    if spec.kind == "label_skew":
        if task != "classification":
            raise ConfigError("partition", spec.text, "iid or by_file for this workload (its task is "
                              f"{task!r}; label_skew splits classes)", "Use by_file for a language model.")
        return dirichlet_split(labels_of(dataset), world, spec.alpha, seed)
    raise ValueError(f"{spec.kind} is not sharded")


def dirichlet_split(labels: torch.Tensor, world: int, alpha: float, seed: int, attempts: int = 100) -> list[list[int]]:
    """Hsu et al.'s split: per class, ``Dir(alpha)`` proportions over the ranks; redrawn (seeded) until
    every rank holds at least one item."""
    import numpy as np

    y = labels.numpy()
    for attempt in range(attempts):
        rng = np.random.default_rng([seed, attempt])
        out: list[list[int]] = [[] for _ in range(world)]
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            cuts = np.round(np.cumsum(rng.dirichlet([alpha] * world)) * len(idx)).astype(int)
            for r, part in enumerate(np.split(idx, cuts[:-1])):
                out[r].extend(int(i) for i in part)
        if all(out):
            return [sorted(s) for s in out]
    raise ConfigError("partition", f"label_skew:alpha={alpha:g}", f"an alpha that leaves none of the {world} ranks "
                      "without data", "Raise alpha or use fewer ranks.")


class ShardSampler:
    """A rank's batch at each step, from its own shard only (see the module docstring)."""

    def __init__(self, shard: list[int], seed: int, rank: int) -> None:
        if not shard:
            raise ConfigError("partition", f"an empty shard for rank {rank}", "at least one training item per rank",
                              "Use fewer ranks, or give the workload at least as many training items (by_file: "
                              "files) as ranks.")
        self.shard, self.seed, self.rank = shard, seed, rank
        self._samplers: dict[int, GlobalSampler] = {}

    def indices(self, step: int, size: int) -> list[int]:
        sampler = self._samplers.get(size)
        if sampler is None:
            sampler = self._samplers[size] = GlobalSampler(len(self.shard), size, self.seed * 7_919 + 104_729 * self.rank)
        return [self.shard[i] for i in sampler.global_indices(step)]
