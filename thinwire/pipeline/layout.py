"""A pipeline's layout for a world size: stages, replicas, each stage's layers and the micro-batch count,
checked before anything starts (``thinwire train`` runs :func:`layout` in its preflight, the workers
again at start).
"""

from __future__ import annotations

import dataclasses

from thinwire.errors import ConfigError
from thinwire.pipeline.stages import Layer, balanced_split, layer_params, split_from_counts

MICROBATCHES_PER_STAGE = 4  # GPipe (Huang et al. 2019): the bubble is negligible from M >= 4 x stages


@dataclasses.dataclass(frozen=True)
class Layout:
    """``replicas`` pipelines of ``stages`` ranks, each rank holding ``virtual`` stages (interleaved; else 1):
    ``runs[k]``: the layer indices of stage ``k``, on the replica's rank ``k % stages``."""

    stages: int
    replicas: int
    runs: list[list[int]]
    microbatches: int
    replica_batch: int
    layer_names: list[str]
    links: list[str]                   # activation format of link k (stage k -> k+1)
    virtual: int = 1

    def rank_stages(self, rank_stage: int) -> list[int]:
        """The stages the replica's rank ``rank_stage`` holds: ``rank_stage``, ``+ stages``, ..."""
        return list(range(rank_stage, self.stages * self.virtual, self.stages))

    def describe(self) -> str:
        cut = " | ".join("+".join(self.layer_names[i] for i in run) for run in self.runs)
        links = "" if set(self.links) <= {"fp32"} else ", links " + "/".join(self.links)
        ranks = f", {self.virtual} per rank" if self.virtual > 1 else ""
        return (f"{self.replicas} x {len(self.runs)}-stage pipeline{ranks}, {self.microbatches} micro-batches of "
                f"{self.replica_batch // self.microbatches}: {cut}{links}")


def default_microbatches(replica_batch: int, stages: int, interleaved: bool = False) -> int:
    """The largest divisor of the replica's batch that is at most 4 x stages (interleaved: that is also a
    multiple of its rounds, ``M // stages``, as torch's ``ScheduleInterleaved1F1B`` needs)."""
    return max(m for m in range(1, min(replica_batch, MICROBATCHES_PER_STAGE * stages) + 1)
               if replica_batch % m == 0 and (not interleaved or m % max(1, m // stages) == 0))


def layout_of(spec, layers: list[Layer], world: int, batch: int) -> Layout:
    """:func:`layout` for a model's layer list."""
    return layout(spec, [layer.name for layer in layers], [layer_params(layer) for layer in layers], world, batch)


def layout(spec, names: list[str], params: list[int], world: int, batch: int) -> Layout:
    """The layout of ``spec`` (a :class:`~thinwire.pipespec.PipelineSpec`) for ``world`` ranks and a global batch,
    over a layer list of ``names`` holding ``params`` parameters each."""
    stages, layers, V = spec.stage_count(world), names, spec.virtual
    counts = "/".join(map(str, spec.layers or ()))
    if V > 1 and spec.layers and not spec.stages and (len(spec.layers) % V or len(spec.layers) // V < 2):
        raise ConfigError("pipeline.layers", counts, f"one layer count per stage: with interleaved, a multiple of "
                          f"virtual={V} counts for at least 2 ranks ({2 * V} or more)",
                          f"E.g. {world * V} counts for {world} ranks, or leave layers= out.")
    if V > 1 and stages < 2:  # torch's interleaved schedule fails on one rank (a stage with no backward to run)
        raise ConfigError("pipeline.stages", stages, "at least 2 with the interleaved schedule",
                          "On one rank there is no bubble to fill: use 1f1b, or more workers.")
    if V > 1 and stages <= len(layers) < stages * V:  # the stages fit; their virtual ones do not
        raise ConfigError("pipeline.virtual", V, f"at most {len(layers) // stages}: {stages} ranks x virtual stages "
                          f"each hold at least one of the model's {len(layers)} layers ({', '.join(names)})",
                          "Use fewer virtual stages per rank, or a workload with a longer layer list."
                          if len(layers) // stages >= 2 else "Interleaving needs 2 layers per rank: use 1f1b, fewer "
                          "stages, or a workload with a longer layer list.")
    if stages * V > len(layers):
        default = "" if spec.stages or spec.layers else f" (stages defaults to one per worker: {world} workers)"
        raise ConfigError("pipeline.stages", stages, f"at most the model's {len(layers)} layers ({', '.join(names)})"
                          + (f" over virtual={V} stages per rank" if V > 1 else "") + default,
                          "A stage holds at least one layer: use fewer stages"
                          + (" or fewer virtual ones" if V > 1 else "")
                          + (" (stages=S gives replicas of S stages, or run fewer workers)" if default else "")
                          + ", or a workload with a longer layer list.")
    if world % stages:
        if spec.layers and not spec.stages:  # the stage count came from layers=
            raise ConfigError("pipeline.layers", counts, f"as many counts as a divisor of the number of workers "
                              f"({world}): {len(spec.layers)} counts are {stages} stages",
                              f"The workers (--nproc, or the cluster's hosts) form replicas x stages: run "
                              f"{stages * max(1, world // stages)} of them, or give {world} counts.")
        raise ConfigError("pipeline.stages", stages, f"a divisor of the number of workers ({world})",
                          f"The workers (--nproc, or the cluster's hosts) form replicas x stages: e.g. "
                          f"{stages * max(1, world // stages)} of them, or stages={world}.")
    replicas = world // stages
    if batch % replicas:
        raise ConfigError("batch_size", batch, f"divisible by the {replicas} pipeline replicas",
                          f"Use {(batch // replicas + 1) * replicas}.")
    replica_batch = batch // replicas
    micro = spec.microbatches or default_microbatches(replica_batch, stages, V > 1)
    if replica_batch % micro:
        raise ConfigError("pipeline.microbatches", micro, f"a divisor of a replica's batch ({replica_batch})",
                          f"Leave it out for {default_microbatches(replica_batch, stages, V > 1)}.")
    if spec.schedule == "1f1b" and micro < stages:
        raise ConfigError("pipeline.microbatches", micro, f"at least the {stages} stages with 1f1b (a replica's batch "
                          f"is {replica_batch})", "1F1B keeps every stage busy only with one micro-batch per stage in "
                          "flight: raise the batch size, or use gpipe.")
    rounds = max(1, micro // stages)
    if V > 1 and micro % rounds:  # torch's ScheduleInterleaved1F1B runs micro-batches in rounds of about S
        fits = [m for m in range(1, replica_batch + 1) if replica_batch % m == 0 and m % max(1, m // stages) == 0]
        raise ConfigError("pipeline.microbatches", micro, f"a multiple of its rounds (micro-batches // stages = "
                          f"{rounds}) with interleaved", f"E.g. {', '.join(map(str, fits[-4:]))}.")
    if spec.layers:
        runs = split_from_counts(list(spec.layers), len(layers), names)
    else:
        runs = balanced_split([float(n) for n in params], stages * V)
    return Layout(stages=stages, replicas=replicas, runs=runs, microbatches=micro, replica_batch=replica_batch,
                  layer_names=names, links=spec.link_formats(stages * V), virtual=V)
