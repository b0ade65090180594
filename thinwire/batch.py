"""A batch's inputs or targets as a workload gives them: a tensor, or dicts, lists and tuples of tensors
(a model taking ``{"input_ids": ..., "attention_mask": ...}``, or two images). What the trainer does to a
batch (move it to the device, cut it into micro-batches, count its samples) is done to every tensor in it;
anything that is not a tensor (a string, a number) travels with every piece unchanged.

    >>> x = {"a": torch.zeros(4, 2), "b": [torch.ones(4), "tag"]}
    >>> batch_len(x), [batch_len(p) for p in split(x, [3, 1])], rebuild(x, tensors(x))["b"][1]
    (4, [3, 1], 'tag')
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map_only

from thinwire.errors import ThinwireError


def tree_map(fn: Callable[[Tensor], Any], x: Any) -> Any:
    """``x`` with ``fn`` applied to every tensor in it (torch's pytree: dicts, lists, tuples and named tuples
    kept as they are)."""
    return tree_map_only(Tensor, fn, x)


def tensors(x: Any) -> list[Tensor]:
    """Every tensor in ``x``, in order."""
    return [t for t in tree_leaves(x) if isinstance(t, Tensor)]


def rebuild(template: Any, leaves) -> Any:
    """``template``'s structure with its tensors replaced, in order, by ``leaves`` (``tensors``' inverse)."""
    it = iter(leaves)
    return tree_map(lambda _: next(it), template)


def batch_len(x: Any) -> int:
    """Samples in ``x``: the first dimension of its tensors, which must agree."""
    sizes = {t.shape[0] if t.dim() else None for t in tensors(x)}
    if len(sizes) != 1 or None in sizes:
        found = "no tensor" if not sizes else f"first dimensions {sorted(s for s in sizes if s is not None)}" + (
            " and a 0-d tensor" if None in sizes else "")
        raise ThinwireError(f"workload: a batch must be a tensor, or dicts, lists and tuples of tensors with one first "
                            f"dimension (the samples); this one has {found}. Give every item of the dataset the same "
                            "structure, with a tensor per field.")
    return sizes.pop()


def to(x: Any, device: torch.device, non_blocking: bool = False) -> Any:
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), x)


def split(x: Any, sizes: list[int]) -> list[Any]:
    """``x`` cut along its first dimension into pieces of ``sizes`` samples (views, as ``Tensor.split``)."""
    return _pieces(x, lambda t: t.split(list(sizes)), len(sizes))


def tensor_split(x: Any, n: int) -> list[Any]:
    """``x`` cut into ``n`` nearly equal pieces (``Tensor.tensor_split``)."""
    return _pieces(x, lambda t: t.tensor_split(n), n)


def _pieces(x: Any, cut: Callable[[Tensor], tuple], n: int) -> list[Any]:
    batch_len(x)  # one first dimension, or a clear error
    cuts = {}  # id of each tensor -> its pieces

    def keep(t: Tensor) -> Tensor:
        cuts[id(t)] = cut(t)
        return t

    tree_map(keep, x)
    return [tree_map(lambda t, i=i: cuts[id(t)][i], x) for i in range(n)]
