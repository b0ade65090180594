"""The plan file: what ``thinwire plan`` decided, and the small pure helpers ``train --plan`` executes it with.

A plan is YAML (:func:`save_plan` / :func:`load_plan`). Its ``chosen`` entry is a :class:`Decision`,
everything the trainer needs:

* ``hosts``: the hosts that train, in rank order (a host left out is listed in ``left_out``);
* ``shares``: each host's per-step batch (uneven so fast hosts do not wait; they sum to
  ``global_batch``); ``micro``: the micro-batch each host accumulates over to fit its memory;
* ``collective``: ``ring`` (one all-reduce over every host), ``hierarchical`` (``groups``, the first
  host of each group its leader: dense fp32 inside a group, the bucket's codec between leaders) or
  ``switch`` (the int8 buckets through the aggregator on the cluster's switch, the others around the
  ring: ``thinwire train --plan`` starts the aggregator, as ``--aggregation switch`` does);
* ``codecs``: the codec spec of each DDP bucket (profile's layout at ``bucket_mb``).

With uneven shares each rank's loss is its own batch's mean, and DDP averages the ranks' gradients
with equal weights; :func:`loss_weight` rescales rank ``r``'s loss by ``share_r * world / global_batch``
so that the average is exactly the gradient of the global batch's mean loss:
``(1/W) sum_r (s_r W / B) grad mean_r = sum_r (s_r / B) grad mean_r = grad mean_B``.

A plan records fingerprints of the cluster spec and of the workload (name and resolved model
options): :func:`load_plan` refuses a plan made for another cluster or workload, naming what differs.

Example::

    plan = load_plan("plan.yaml", spec, "charlm", {"width": 128})
    shares = plan.shares(world)                     # per-rank batch, rank order = plan.hosts
    loss = loss_fn(model(x), y) * loss_weight(rank, shares)
    state = attach_plan(ddp_model, plan)            # per-bucket codecs, ring or hierarchical
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Literal

from thinwire.compress.hook import Policy
from thinwire.config import check, check_range, load_dataclass, save_yaml
from thinwire.errors import ConfigError, ThinwireError

log = logging.getLogger("thinwire.plan")
VERSION = 1


@dataclasses.dataclass(kw_only=True)
class Decision:
    """One complete candidate plan and its predicted step (see the module docstring)."""

    name: str
    hosts: list[str]
    shares: list[int]
    micro: list[int]
    collective: Literal["ring", "hierarchical", "switch"] = "ring"  # switch: int8 through the switch's aggregator
    groups: list[list[str]] = dataclasses.field(default_factory=list)
    codecs: list[str]
    left_out: list[str] = dataclasses.field(default_factory=list)
    predicted_step_s: float
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    bytes_per_step: int = 0
    sample_factor: float = 1.0  # samples relative to DDP fp32 to reach its loss (the convergence guard's; 1: not priced)
    validation_s: float = 0.0   # one validation's predicted seconds on these hosts (0: not priced)

    def __post_init__(self) -> None:
        n = len(self.hosts)
        check(n >= 1, "hosts", self.hosts, "at least one host")
        _check_unique("hosts", self.hosts + self.left_out, "each host once, in hosts or in left_out")
        check(len(self.shares) == n and len(self.micro) == n, "shares", self.shares, f"one entry per host ({n})")
        check(all(1 <= s <= MAX_BATCH for s in self.shares), "shares", self.shares, f"integers in [1, {MAX_BATCH}]")
        check(all(1 <= m <= s for m, s in zip(self.micro, self.shares)), "micro", self.micro,
              "per host an integer in [1, its share]")
        if self.collective == "hierarchical":
            flat = sorted(h for g in self.groups for h in g)
            check(flat == sorted(self.hosts), "groups", self.groups, "a partition of the plan's hosts")
        if self.collective == "switch":
            from thinwire.compress.schemes.switched import switchable

            check(not self.groups, "groups", self.groups, "none with collective switch")
            check(any(switchable(c) for c in self.codecs), "codecs", self.codecs,
                  "an int8 codec with nearest rounding in some bucket with collective switch",
                  "The switch sums int8 only; make the plan again with `thinwire plan`.")
        for name in ("predicted_step_s", "compute_s", "exposed_comm_s", "validation_s"):
            check_range(name, getattr(self, name), 0, 1e9, fix="Seconds; make the plan again with `thinwire plan`.")
        check_range("bytes_per_step", self.bytes_per_step, 0, 2**62, kind="an integer")
        check_range("sample_factor", self.sample_factor, 1, 1e6, fix="Make the plan again with `thinwire plan`.")
        self._check_codecs()

    def _check_codecs(self) -> None:
        from thinwire.compress.spec import parse_codec_spec

        for i, spec in enumerate(self.codecs):
            try:
                parse_codec_spec(spec)
            except ConfigError as e:
                raise ConfigError(f"codecs[{i}]", spec, "a codec spec such as int8:block=64", str(e)) from None

    def check_hosts(self, known: list[str], where: str) -> None:
        """Refuse hosts the cluster does not have (``where`` names the decision, e.g. ``plan.chosen``)."""
        for field, names in (("hosts", self.hosts), ("left_out", self.left_out)):
            for i, h in enumerate(names):
                check(h in known, f"{where}.{field}[{i}]", h, f"a host of the cluster ({', '.join(known)})",
                      "Make the plan again for this cluster: thinwire plan --cluster SPEC ...")


MAX_BATCH = 10**9


def _check_unique(field: str, names: list[str], allowed: str) -> None:
    seen = set()
    for name in names:
        check(name not in seen, field, name, allowed, "A host appears twice; make the plan again.")
        seen.add(name)


@dataclasses.dataclass(kw_only=True)
class Stage:
    """One pipeline stage: layers ``first_layer..last_layer`` of the workload's layer list on ``host``."""

    host: str
    first_layer: int
    last_layer: int
    layers: list[str]
    parameters: int
    memory_bytes: int
    seconds_per_microbatch: float


@dataclasses.dataclass(kw_only=True)
class PipelinePlan:
    """A pipeline over the hosts (stage s on ``stages[s].host``; interleaved: ``virtual`` stages per host, stage k
    on the host of stage ``k % hosts``), run by ``train --plan`` as ``--pipeline
    SCHEDULE:stages=S,microbatches=M,layers=...,activations=...`` (:meth:`spec_text`)."""

    stages: list[Stage]
    schedule: str
    microbatches: int
    links: list[str]
    predicted_step_s: float
    even_split_step_s: float
    even_split: list[int]
    bottleneck: str
    recompute: bool = False
    note: str = ""
    virtual: int = 1
    alternative_step_s: dict[str, float] = dataclasses.field(default_factory=dict)  # other schedules' best, priced
    left_out: list[str] = dataclasses.field(default_factory=list)  # hosts of the spec without a stage, by choice
    with_all_hosts_step_s: float | None = None  # with left_out: the best pipeline over every host

    def __post_init__(self) -> None:
        check_range("virtual", self.virtual, 1, 64, kind="an integer")
        check(len(self.stages) % self.virtual == 0, "pipeline.stages", len(self.stages),
              f"a multiple of virtual ({self.virtual})", "Make the plan again.")

    @property
    def hosts(self) -> list[str]:
        return [s.host for s in self.stages[: len(self.stages) // self.virtual]]

    def spec_text(self) -> str:
        counts = "/".join(str(s.last_layer - s.first_layer + 1) for s in self.stages)
        text = f"{self.schedule}:stages={len(self.hosts)},microbatches={self.microbatches},layers={counts}"
        text += f",virtual={self.virtual}" if self.virtual > 1 else ""
        text += ",activations=" + "/".join(self.links) if set(self.links) - {"fp32"} else ""
        return text + (",recompute=on" if self.recompute else "")


@dataclasses.dataclass(kw_only=True)
class Plan:
    version: int = VERSION
    cluster: str
    cluster_fingerprint: str
    cluster_hosts: dict[str, str]           # host -> "group, cpu, bit/s, memory": for naming a mismatch
    workload: str
    model: dict = dataclasses.field(default_factory=dict)
    workload_fingerprint: str
    parameters: int
    global_batch: int
    bucket_mb: float
    bucket_numels: list[int]
    threads: int = 1
    executable: bool = True
    chosen: Decision | None = None
    alternatives: list[Decision] = dataclasses.field(default_factory=list)
    baselines: dict[str, float | str] = dataclasses.field(default_factory=dict)
    explanation: list[str] = dataclasses.field(default_factory=list)
    pipeline: PipelinePlan | None = None
    planning: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check(self.version == VERSION, "version", self.version, f"{VERSION}",
              "The plan was written by another thinwire version; run `thinwire plan` again.")
        check_range("threads", self.threads, 1, 1024, kind="an integer")
        check_range("global_batch", self.global_batch, 1, MAX_BATCH, kind="an integer")
        check_range("parameters", self.parameters, 0, 2**62, kind="an integer")
        check_range("bucket_mb", self.bucket_mb, 0, 4096, open_lo=True)
        check(all(0 <= n < 2**62 for n in self.bucket_numels), "bucket_numels", self.bucket_numels,
              "integers >= 0")
        if self.chosen is not None:
            check(sum(self.chosen.shares) == self.global_batch, "chosen.shares", self.chosen.shares,
                  f"integers summing to global_batch ({self.global_batch})")

    # -- what the trainer calls ------------------------------------------------------------------
    @property
    def decision(self) -> Decision:
        if self.pipeline is not None and self.executable:
            raise ThinwireError("plan: this is a pipeline plan: it has stages, not data-parallel shares")
        if self.chosen is None or not self.executable:
            raise ThinwireError("plan: this plan is not executable: " + (self.pipeline.note if self.pipeline else
                                "it holds no data-parallel decision") + ". Plan for hosts that can hold the model.")
        return self.chosen

    @property
    def hosts(self) -> list[str]:
        """The hosts that train, in rank order (a pipeline's: in stage order)."""
        if self.pipeline is not None and self.executable:
            return self.pipeline.hosts
        return list(self.decision.hosts)

    def shares(self, world: int) -> list[int]:
        """Per-rank batch sizes (rank ``r`` is ``hosts[r]``); ``world`` must be the plan's host count."""
        d = self.decision
        if world != len(d.hosts):
            raise ThinwireError(f"plan: made for {len(d.hosts)} workers ({', '.join(d.hosts)}), but this job has "
                                f"{world}. Launch exactly the plan's hosts" +
                                (f" (it leaves out {', '.join(d.left_out)})" if d.left_out else "") + ".")
        return list(d.shares)

    def micro_batch(self, rank: int) -> int:
        return self.decision.micro[self._rank(rank)]

    def micro_sizes(self, rank: int) -> list[int]:
        """Rank ``rank``'s share cut into near-equal micro-batches of at most ``micro_batch(rank)``."""
        share, micro = self.decision.shares[self._rank(rank)], self.micro_batch(rank)
        k = math.ceil(share / micro)
        return [share // k + (1 if i < share % k else 0) for i in range(k)]

    def codec_spec(self, bucket: int) -> str:
        """The codec of DDP bucket ``bucket`` (``none`` beyond the planned layout)."""
        codecs = self.decision.codecs
        return codecs[bucket] if 0 <= bucket < len(codecs) else "none"

    def policy(self) -> "PlanPolicy":
        return PlanPolicy(self.decision.codecs, self.bucket_numels)

    def rank_groups(self) -> list[list[int]]:
        """Hierarchical groups as rank lists (leader first); one group of all ranks for a ring."""
        d = self.decision
        if d.collective != "hierarchical":
            return [list(range(len(d.hosts)))]
        return [[d.hosts.index(h) for h in g] for g in d.groups]

    def select(self, index: int) -> "Plan":
        """A copy whose chosen decision is ``alternatives[index]`` (to measure an alternative)."""
        alt = self.alternatives[index]
        return dataclasses.replace(self, chosen=alt, alternatives=[self.decision] + [
            a for i, a in enumerate(self.alternatives) if i != index])

    def _rank(self, rank: int) -> int:
        n = len(self.decision.hosts)
        if not 0 <= rank < n:
            raise ThinwireError(f"plan: rank {rank} is outside the plan's {n} workers.")
        return rank


def loss_weight(rank: int, shares: list[int]) -> float:
    """Scale of rank ``rank``'s mean loss so DDP's equal average is the global-batch mean gradient:
    ``share_r * world / global_batch`` (1.0 for even shares)."""
    if not 0 <= rank < len(shares) or min(shares) < 1:
        raise ValueError(f"rank must index shares and shares must be >= 1, got rank {rank}, shares {shares}")
    return shares[rank] * len(shares) / sum(shares)


class PlanPolicy(Policy):
    """The hook's :class:`~thinwire.compress.hook.Policy` for a plan: a fixed codec per bucket index.

    Every rank holds the same plan, so every rank answers identically. A bucket whose size differs
    from the planned layout (another ``bucket_mb``, another model) is logged once."""

    def __init__(self, codecs: list[str], numels: list[int] | None = None) -> None:
        from thinwire.compress.spec import parse_codec_spec

        self.specs = list(codecs)
        self.codecs = [parse_codec_spec(c) for c in self.specs]
        self.none = parse_codec_spec("none")
        self.numels = list(numels or [])
        self._warned: set[int] = set()

    def codec_for(self, bucket: int, numel: int, step: int):
        if bucket < len(self.numels) and self.numels[bucket] != numel and bucket not in self._warned:
            self._warned.add(bucket)
            log.warning("plan: bucket %d holds %d values, the plan expected %d; its planned codec is used anyway",
                        bucket, numel, self.numels[bucket])
        return self.codecs[bucket] if bucket < len(self.codecs) else self.none

    def describe(self) -> str:
        if len(set(self.specs)) == 1:
            return f"plan[{self.specs[0]}]"
        return "plan[" + ", ".join(f"{i}:{c}" for i, c in enumerate(self.specs)) + "]"


def attach_plan(model, plan: Plan, **attach_kwargs):
    """Attach the plan's communication to a DDP ``model`` (rank ``r`` is ``plan.hosts[r]``): per-bucket
    codecs over a ring, or the hierarchical collective (:mod:`thinwire.compress.hierarchical`) over
    ``plan.rank_groups()``. ``attach_kwargs`` (error_feedback, warmup_steps, timeout_s, ...) go to ``attach``."""
    if plan.decision.collective == "hierarchical":
        from thinwire.compress.hierarchical import attach_hierarchical

        return attach_hierarchical(model, plan.policy(), groups=plan.rank_groups(), **attach_kwargs)
    from thinwire.compress.hook import attach

    return attach(model, plan.policy(), **attach_kwargs)


# -- fingerprints ---------------------------------------------------------------------------------
def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def host_summary(spec) -> dict[str, str]:
    """Host -> what the plan depends on, in words (compared to name a mismatch)."""
    out = {}
    for h in spec.hosts:
        mem = f"{h.memory} B" if h.memory else "no memory limit"
        nic = f", nic cpu {h.nic.cpu:g}" if h.nic is not None else ""  # named only where there is one: plans of
        out[h.name] = (f"group {h.group}, cpu {h.cpu if h.cpu is not None else 'uncapped'}, {h.bandwidth / 1e6:g} "
                       f"Mbit/s, {mem}{nic}")  # clusters without keep their fingerprints
    for link in spec.links:
        a, b = sorted(link.between)
        loss = f", loss {link.loss:g}" if link.loss else ""
        out[f"link {a}-{b}"] = f"{link.bandwidth / 1e6:g} Mbit/s, latency {link.latency or 0:g} s{loss}"
    if spec.switch is not None:  # the planner prices an aggregator there
        out["switch"] = f"aggregator cpu {spec.switch.cpu if spec.switch.cpu is not None else 'uncapped'}"
    return out


def cluster_fingerprint(spec) -> str:
    """What the plan depends on: hosts and links, resolved (not the cluster's name or subnet)."""
    return _digest(host_summary(spec))


def normalized_model(workload: str, model: dict) -> dict:
    """Model options with a built-in workload's defaults filled in (``width=128`` given or not)."""
    from thinwire.workloads.registry import model_defaults

    return {**model_defaults(workload), **dict(model)}


def same_model(plan: "Plan", workload: str, model: dict) -> bool:
    """Whether ``plan`` was made for this workload and these model options, an option the plan does not
    record counting as its default (a newer thinwire's option, e.g. ``drift_step``, leaves older plans
    valid as long as it is left at its default)."""
    if plan.workload != workload or not isinstance(plan.model, dict):
        return False
    from thinwire.workloads.registry import model_defaults

    defaults, mine = model_defaults(workload), normalized_model(workload, model)
    return set(plan.model) <= set(mine) and all(plan.model.get(k, defaults.get(k)) == v for k, v in mine.items())


def workload_fingerprint(workload: str, model: dict) -> str:
    return _digest({"workload": workload, "model": normalized_model(workload, model)})


# -- reading and writing --------------------------------------------------------------------------
def save_plan(plan: Plan, path: str | Path) -> Path:
    return save_yaml(plan, path)


def read_plan(path: str | Path) -> Plan:
    """Read a plan file without checking it against a cluster or workload."""
    return load_dataclass(Plan, path, what="plan",
                          make=f"Make one with `thinwire plan --cluster SPEC --workload W --out {path}`.")


def load_plan(path: str | Path, spec, workload_name: str, model_options: dict, *,
              batch_size: int | None = None) -> Plan:
    """Read a plan and refuse it unless it was made for ``spec`` and this workload (and, if given,
    this global batch); the error names what differs."""
    plan = read_plan(path)

    def fix(tag: str) -> str:  # into a file of its own: the plan refused is a good plan for its own cluster or model
        p = Path(path)
        new = p.with_name(f"{p.stem}-{''.join(c if c.isalnum() else '-' for c in tag)}{p.suffix or '.yaml'}")
        return (f"Make a plan for this run in a new file (leaving {path} as it is): thinwire plan --cluster SPEC "
                f"--workload {workload_name} --out {new}, and train with --plan {new}")

    if plan.cluster_fingerprint != cluster_fingerprint(spec):
        raise ThinwireError(f"plan: {path} was made for cluster {plan.cluster!r}, not for this cluster "
                            f"{spec.name!r}: {_diff(plan.cluster_hosts, host_summary(spec))}. {fix(spec.name)}.")
    if plan.workload_fingerprint != workload_fingerprint(workload_name, model_options) and \
            not same_model(plan, workload_name, model_options):
        mine = normalized_model(workload_name, model_options)
        from thinwire.workloads.registry import model_defaults

        # options newer than the plan count as their defaults
        theirs = {**{k: v for k, v in model_defaults(workload_name).items() if k in mine}, **plan.model}
        what = f"workload {plan.workload!r}, not {workload_name!r}" if plan.workload != workload_name else \
            "model options " + _diff(theirs, mine)
        raise ThinwireError(f"plan: {path} was made for another workload: {what}. {fix(workload_name)}.")
    if batch_size is not None and batch_size != plan.global_batch:
        raise ConfigError("batch_size", batch_size, f"the plan's global batch ({plan.global_batch})",
                          "Leave --batch-size out with --plan, or plan again with --batch-size.")
    for where, decision in [("plan.chosen", plan.chosen)] + [
            (f"plan.alternatives[{i}]", a) for i, a in enumerate(plan.alternatives)]:
        if decision is not None:
            decision.check_hosts(spec.host_names, where)
    return plan


def _diff(planned: dict, now: dict) -> str:
    parts = []
    for key in sorted(set(planned) | set(now), key=str):
        if planned.get(key) != now.get(key):
            old = "absent" if key not in planned else f"{planned[key]}"
            new = "absent" if key not in now else f"{now[key]}"
            parts.append(f"{key}: {old} in the plan, {new} now")
    return "; ".join(parts[:4]) + (f" (and {len(parts) - 4} more)" if len(parts) > 4 else "") if parts else "same values"
