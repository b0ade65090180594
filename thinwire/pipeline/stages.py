"""A model cut into pipeline stages: its layer list, a contiguous split of it, and the parameters that
stages share.

A model is pipelined along a **layer list**: modules in forward order, each taking the previous one's
output (a tensor, or a tuple of tensors) as its only input. A workload names it
(:attr:`thinwire.workloads.base.Workload.layers`, charlm: embedding, each block, the head); an
``nn.Sequential`` is its own list. A stage is a contiguous run of layers (:class:`StageModule`); its
parameters keep their names in the whole model, so a pipelined run's checkpoint holds the same
``model`` state dict as a data-parallel run's.

**Shared parameters.** A weight used by two stages (charlm's head is tied to its token embedding, Press
& Wolf 2017) exists once per stage that uses it. The copies start equal (every rank builds the model
from the same seed) and stay equal because their gradients are summed over the stages that hold them
before each optimizer step (:func:`shared_parameters`; Megatron-LM does the same for its tied word
embeddings): the sum is exactly the gradient the single-process model accumulates in its one tensor.

**Splitting.** Without boundaries, :func:`balanced_split` cuts the list into ``stages`` runs with the
smallest largest parameter count (a contiguous partition by dynamic programming); a plan's split
(by measured host speed and memory) or the user's ``layers=A/B/C`` replaces it.

    >>> balanced_split([1, 1, 4, 1, 1], 3)  # parameters per layer -> layer indices per stage
    [[0, 1], [2], [3, 4]]
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from thinwire import batch as B
from thinwire.errors import ThinwireError
from thinwire.perf.pipeline import split_for_speeds


@dataclasses.dataclass(frozen=True)
class Layer:
    """One entry of a model's layer list: its name (for messages and plans) and the module."""

    name: str
    module: nn.Module


def layer_list(model: nn.Module, layers: Callable[[nn.Module], list[tuple[str, nn.Module]]] | None,
               workload: str = "the workload") -> list[Layer]:
    """The model's layers in forward order: the workload's ``layers(model)``, or an ``nn.Sequential``'s children.
    A list that leaves out a parameter or buffer of the model (which no stage would train or checkpoint), or holds
    a module that is not the model's (trained, but in no checkpoint), is refused, naming them."""
    if layers is not None:
        return _cover(model, _call_layers(layers, model, workload), workload)
    if isinstance(model, nn.Sequential):  # every entry, as its forward runs them: named_children() skips a repeat
        return [Layer(name, module) for name, module in model._modules.items() if module is not None]
    if ":" not in workload and workload != "the workload":  # built in (a user's is module:function): nothing to add
        raise ThinwireError(f"pipeline: the built-in workload {workload} ({type(model).__name__}) has no layer list "
                            "to cut into stages; charlm has one. Pipeline charlm, or a workload of your own that "
                            "returns Workload(..., layers=lambda model: [(name, module), ...]).")
    raise ThinwireError(
        f"pipeline: {workload}'s model ({type(model).__name__}) has no layer list to cut into stages. Return "
        "Workload(..., layers=lambda model: [(name, module), ...]) from the workload function (modules in "
        "forward order, each taking the previous one's output), or make the model an nn.Sequential.")


def _call_layers(layers: Callable, model: nn.Module, workload: str) -> list[Layer]:
    """``layers(model)`` as a list of :class:`Layer`; what it raises or returns amiss is one error line."""
    try:
        entries = list(layers(model))
    except Exception as e:  # the user's function: its error, where it raised, not our traceback
        raise ThinwireError(f"pipeline: {workload}'s layers(model) raised {type(e).__name__}: {e}. Call it in Python "
                            "to see the whole traceback.") from None
    out = []
    for i, entry in enumerate(entries):
        ok = isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[1], nn.Module)
        if not ok:
            got = type(entry[1]).__name__ if isinstance(entry, (tuple, list)) and len(entry) == 2 else repr(entry)[:60]
            raise ThinwireError(f"pipeline: {workload}'s layers(model)[{i}] must be a (name, nn.Module) pair, got "
                                f"{got}. Return [(name, module), ...] in forward order.")
        out.append(Layer(str(entry[0]), entry[1]))
    if not out:
        raise ThinwireError(f"pipeline: {workload}'s layers(model) returned no layers. Return [(name, module), ...] "
                            "in forward order.")
    return out


def _cover(model: nn.Module, layers: list[Layer], workload: str) -> list[Layer]:
    """``layers`` if their parameters and buffers are exactly the model's (by identity), else the error."""
    def tensors(m: nn.Module) -> dict[int, str]:
        return {id(t): n for n, t in [*m.named_parameters(), *m.named_buffers()]}

    mine, held = tensors(model), {}
    for layer in layers:
        held.update({k: layer.name for k in tensors(layer.module)})
    left_out = [n for k, n in mine.items() if k not in held]
    if left_out:
        more = f" and {len(left_out) - 6} more" if len(left_out) > 6 else ""
        raise ThinwireError(f"pipeline: {workload}'s layer list leaves out {', '.join(left_out[:6])}{more} of the model: "
                            "no stage would train or checkpoint them. List every module the forward uses, in order.")
    foreign = sorted({name for k, name in held.items() if k not in mine})
    if foreign:
        raise ThinwireError(f"pipeline: {workload}'s layer {', '.join(foreign)} holds parameters that are not the "
                            "model's: it would train, but no checkpoint holds it. Make it a submodule of the model, "
                            "or leave it out of the layer list.")
    return layers


@torch.no_grad()
def check_chain(layers: list[Layer], x, runs: list[list[int]], links: list[str],
                model: nn.Module | None = None) -> None:
    """Run one sample through the layer list in order (every rank, before the stages are cut): a list that
    does not chain, or a stage output a compressed link cannot carry, is refused with the layer's name on
    every rank at once, not as one stage's crash in the middle of a schedule; with ``model``, a list whose
    chain does not compute ``model(x)`` (a module the forward uses twice but the list once, a forward that
    does more than chain its layers) is refused, since the stages would train another model. In eval mode,
    so that the probe changes nothing (a BatchNorm's running statistics) and a layer that needs a batch to
    train on (BatchNorm in training refuses one sample) is not taken for a list that does not chain."""
    modules = [m for layer in layers for m in layer.module.modules()] + (list(model.modules()) if model else [])
    modes = [(m, m.training) for m in modules]
    for m in modules:
        m.eval()
    try:
        out = _check_chain(layers, x, runs, links)
        if model is not None:
            _check_forward(model, x, out)
    finally:
        for m, training in modes:
            m.training = training


def _check_forward(model: nn.Module, x, chained) -> None:
    try:
        ref = model(x)
    except Exception:  # noqa: BLE001 - a model called otherwise than with the batch's x: nothing to compare
        return
    a, b = B.tensors(chained), B.tensors(ref)
    same = len(a) == len(b) and all(
        u.shape == v.shape and (not u.is_floating_point() or torch.allclose(u.float(), v.float(), rtol=1e-3, atol=1e-5))
        and (u.is_floating_point() or torch.equal(u, v)) for u, v in zip(a, b))
    if not same:
        raise ThinwireError("pipeline: the layer list does not compute the model's forward: one sample through its "
                            "layers in order gives another output than model(x). A module the forward uses twice "
                            "must be listed twice, and a forward that does more than call its layers in order (a "
                            "residual around several of them, a second input) cannot be cut at them: give the "
                            "workload layers(model) whose chain is the forward.")


def _check_chain(layers: list[Layer], x, runs: list[list[int]], links: list[str]):
    """The chain's output (see :func:`check_chain`)."""
    ends = {run[-1]: k for k, run in enumerate(runs[:-1])}  # last layer of each stage but the last -> its link
    for i, layer in enumerate(layers):
        try:
            x = layer.module(*x) if isinstance(x, tuple) else layer.module(x)
        except Exception as e:  # noqa: BLE001 - any failure here is the layer list's, named for the user
            what = ("the model's input (a batch's x)" if i == 0
                    else f"the output of layer {i - 1} ({layers[i - 1].name})")
            raise ThinwireError(f"pipeline: layer {i} ({layer.name}) cannot take {what} "
                                f"({type(e).__name__}: {str(e)[:200]}). A workload's layers(model) lists modules in "
                                "forward order, the first taking the batch's x, each next one the previous one's "
                                "output.") from None
        if i in ends and not (torch.is_tensor(x) or (isinstance(x, tuple) and x and all(map(torch.is_tensor, x)))):
            raise ThinwireError(f"pipeline: layer {i} ({layer.name}) ends a stage and outputs {type(x).__name__}; what "
                                "goes from one stage to the next must be a tensor or a tuple of tensors (the next "
                                "layer takes a tuple's tensors as its arguments). Return those, or cut elsewhere "
                                "(pipeline layers=A/B/..).")
        fmt = links[ends[i]] if i in ends else "fp32"
        if fmt != "fp32" and (not torch.is_tensor(x) or not x.is_floating_point()):
            raise ThinwireError(f"pipeline.activations: {fmt} on the link after layer {layer.name} needs one "
                                f"floating-point tensor, it outputs {type(x).__name__}; use fp32 on that link.")
        if fmt != "fp32" and x.dtype != torch.float32:
            raise ThinwireError(f"pipeline.activations: {fmt} on the link after layer {layer.name} packs float32 "
                                f"activations and unpacks them to float32, it outputs {str(x.dtype).split('.')[-1]}; "
                                "use fp32 on that link.")
        if fmt == "int8" and x.shape[-1] % 32 and x.shape[-1] % 2:
            raise ThinwireError(f"pipeline.activations: int8 packs rows of an even length; layer {layer.name} "
                                f"outputs width {x.shape[-1]}; use bf16 (or fp32) on that link.")
    return x


def layer_params(layer: Layer) -> int:
    return sum(p.numel() for p in layer.module.parameters())


def balanced_split(costs: list[float], stages: int) -> list[list[int]]:
    """Indices of ``costs`` cut into ``stages`` contiguous non-empty runs minimizing the largest run's sum
    (:func:`thinwire.perf.pipeline.split_for_speeds` with equal speeds)."""
    runs = split_for_speeds(list(costs), [1.0] * stages)
    assert runs is not None
    return runs


def split_from_counts(counts: list[int], n_layers: int, names: list[str]) -> list[list[int]]:
    """Runs of layer indices from per-stage layer counts (``layers=2/1/1``), checked against the list."""
    if any(c < 1 for c in counts) or sum(counts) != n_layers:
        raise ThinwireError(
            f"pipeline.layers: the stages' layer counts {'/'.join(map(str, counts))} must be positive and add up to "
            f"the model's {n_layers} layers ({', '.join(names)}). Give one count per stage, or leave layers= out "
            "for a split balanced by parameters.")
    runs, start = [], 0
    for c in counts:
        runs.append(list(range(start, start + c)))
        start += c
    return runs


class StageModule(nn.Module):
    """A contiguous run of layers, applied in order; a tuple output is unpacked into the next layer.

    ``decode``/``encode`` (:mod:`thinwire.pipeline.wire`) unpack the input received from the previous
    stage and pack the output sent to the next one (absent at the pipeline's ends)."""

    def __init__(self, layers: list[Layer], decode: nn.Module | None = None, encode: nn.Module | None = None) -> None:
        super().__init__()
        self.names = [layer.name for layer in layers]
        self.layers = nn.ModuleList(layer.module for layer in layers)
        self.decode, self.encode = decode, encode
        self.structure = None  # the first stage of a batch of dicts or tuples: a batch to rebuild inputs after

    def forward(self, *args):
        x = args if len(args) > 1 else args[0]
        if self.structure is not None:  # the first stage of a structured batch: its tensors, put back together
            x = B.rebuild(self.structure, args)
        if self.decode is not None:
            x = self.decode(x)
        for layer in self.layers:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return self.encode(x) if self.encode is not None else x


def full_names(model: nn.Module) -> dict[int, list[str]]:
    """Each parameter's (and buffer's) names in the whole model's state dict, by tensor identity (a tied
    weight has one per use: charlm's ``tok.weight`` and ``head.weight``)."""
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    return names


def shared_parameters(stages: list[StageModule]) -> dict[int, list[int]]:
    """Parameters held by more than one stage: ``id(param) -> [stage indices]`` (all in this process's model)."""
    holders: dict[int, list[int]] = {}
    for s, stage in enumerate(stages):
        for p in stage.parameters():
            holders.setdefault(id(p), []).append(s)
    return {pid: ss for pid, ss in holders.items() if len(ss) > 1}


def stage_state(stage: nn.Module, names: dict[int, list[str]]) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers under their whole-model names: the stages' states merged are
    the model's ``state_dict()`` (a shared weight appears in each stage holding it, equal)."""
    out = {}
    for t in list(stage.parameters()) + list(stage.buffers()):
        for name in names[id(t)]:
            out[name] = t.detach().clone()
    return out


def load_stage_state(stage: nn.Module, names: dict[int, list[str]], state: dict[str, torch.Tensor]) -> None:
    """Copy a whole-model state dict's entries into this stage's tensors."""
    with torch.no_grad():
        for t in list(stage.parameters()) + list(stage.buffers()):
            t.copy_(state[names[id(t)][0]])
