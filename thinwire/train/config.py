"""The training run's config: one typed dataclass, loaded from YAML with CLI overrides.

Only the trainer reads this. Components own their own sections: ``model:`` is validated by the
workload's config (``CharLMConfig``, ``DigitsConfig``), ``compression`` into a typed spec
(:func:`thinwire.commspec.parse_comm_spec`, kept as ``TrainConfig.comm``).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Literal

from thinwire.config import check, check_range, from_dict, load_yaml, parse_value, save_yaml
from thinwire.errors import ConfigError


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    workload: str = "charlm"
    data: str | None = None
    model: dict = dataclasses.field(default_factory=dict)
    steps: int | None = None            # None: the workload's default
    batch_size: int | None = None       # global batch per optimizer step (all ranks together)
    lr: float | None = None
    weight_decay: float = 0.01
    warmup_steps: int = 20              # linear LR warm-up, then cosine decay to 10%
    schedule: Literal["cosine", "constant"] = "cosine"
    # a resume keeps the horizon (total steps) the schedule had at the run's first start; true: the
    # horizon becomes this launch's steps, the LR of each step then being a straight run's of that length
    reschedule: bool = False
    grad_clip: float | None = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 20              # validate on this many global batches of the validation set (0: all of it)
    log_every: int = 1
    tensorboard: bool = False           # also write every record as TensorBoard scalars under OUT/tensorboard
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    nproc: int = 1
    max_restarts: int = 0
    # with --cluster: hosts may leave (and come back) while at least this many are left: torchrun's
    # --nnodes MIN:MAX; each departure restarts the workers from the last checkpoint (one restart each)
    min_hosts: int | None = None
    threads: int | None = None          # torch threads per worker; None: cores / local workers
    compression: str = "none"
    # when averaging happens: allreduce, delayed, local:period=H, diloco:period=H (thinwire.syncspec)
    sync: str = "allreduce"
    partition: str = "iid"              # iid, label_skew:alpha=A or by_file: which items each rank draws from
    # the model cut into stages on different ranks: none, gpipe[:stages=S,microbatches=M,layers=A/B/..] or 1f1b[:...]
    pipeline: str = "none"
    error_feedback: bool = True
    # steps sent uncompressed before the codec starts: Adam's moment estimates start from true
    # gradients (without it PowerSGD from step 0 ends a short charlm run ~2% higher); 2 is also the
    # earliest PyTorch's PowerSGD hook may start
    compression_warmup: int = 2
    bucket_mb: float = 25.0             # DDP bucket cap
    # where the communication work runs: auto: on the host's offload engine where the cluster spec gives
    # it one (`nic:`), else inline; off: inline (to compare); core:N: on core N of this machine, which the
    # compute threads leave to it (an engine as a pinned core, on real machines)
    offload: str = "auto"
    # how buckets are summed across hosts: ring (collectives among the workers) or switch (int8 through the
    # aggregator on the cluster's switch, spec `switch:`; thinwire.compress.switch)
    aggregation: str = "ring"
    timeout_s: float = 300.0            # a collective stuck this long (dead peer, cut link) fails the run
    precision: Literal["fp32", "bf16", "fp16", "int8", "auto"] = "fp32"
    memory_budget: str | None = None    # e.g. "512MiB": largest micro-batch that fits, accumulated to batch_size
    out: str | None = None
    resume: str | None = None
    cluster: str | None = None
    plan: str | None = None             # a plan file from `thinwire plan` (needs cluster)

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_numbers()
        check(self.data is None or self.data.strip() != "", "data", self.data,
              "a path to a text file or folder", "Leave --data out to use the default corpus.")
        if self.memory_budget is not None:
            _check_size("memory_budget", self.memory_budget)
        self.offload_core = _offload_core(self.offload)
        from thinwire.commspec import parse_comm_spec

        self.comm = parse_comm_spec(self.compression)  # parsed once; below this, nobody reads the string
        from thinwire.commspec import check_sync_pairing
        from thinwire.syncspec import parse_sync_spec

        self.sync_spec = parse_sync_spec(self.sync)
        self.sync_spec = check_sync_pairing(self.sync_spec, self.comm, precision=self.precision, plan=self.plan,
                                            error_feedback=self.error_feedback)
        from thinwire.workloads.partition import parse_partition

        self.partition_spec = parse_partition(self.partition)
        from thinwire.pipespec import parse_pipeline_spec

        self.pipeline_spec = parse_pipeline_spec(self.pipeline)
        if self.pipeline_spec.enabled:
            self._check_pipeline()
        self._check_aggregation()

    def _check_aggregation(self) -> None:
        """``switch``: what the aggregator on the switch sums (int8 with nearest rounding, every step's
        buckets of one fixed set of hosts); each other case refused with the way to run it."""
        from thinwire.commspec import AutoSpec, CodecSpec

        check(self.aggregation in ("ring", "switch"), "aggregation", self.aggregation, "ring or switch")
        if self.aggregation == "ring":
            return
        from thinwire.compress.schemes.switched import Switched, switchable

        ring = "Use --aggregation ring (the default) for it."
        check(self.cluster is not None, "cluster", self.cluster, "a cluster spec with --aggregation switch",
              "The aggregator runs on the emulated cluster's switch (spec `switch: {cpu: 0.5}`); without a cluster, "
              "use --aggregation ring (the default).")
        codec = self.comm.codec if isinstance(self.comm, CodecSpec) else None
        auto = isinstance(self.comm, AutoSpec) and any(switchable(c) for c in self.comm.config.candidates)
        check(self.plan is not None or auto or (codec is not None and Switched.accepts(codec)),
              "compression", self.compression,
              "int8 (8 bits, nearest rounding, any block), or auto with int8 among its candidates, with --aggregation switch",
              "The switch sums int8 at agreed block scales; other codecs travel around the ring: " + ring)
        check(self.sync_spec.mode == "allreduce", "sync", self.sync, "allreduce with --aggregation switch", ring)
        check(self.min_hosts is None, "min_hosts", self.min_hosts, "left out with --aggregation switch",
              "The aggregator expects a fixed set of hosts. " + ring)
        check(not self.pipeline_spec.enabled, "aggregation", self.aggregation, "ring with --pipeline",
              "Leave --pipeline out to aggregate in the switch.")

    def _check_pipeline(self) -> None:
        """What a pipelined run does not do (yet): each refused with the way to run without it."""
        from thinwire.commspec import CodecSpec

        off = "Leave --pipeline out to train data-parallel with it."
        check(self.precision in ("fp32", "bf16"), "precision", self.precision, "fp32 or bf16 with --pipeline", off)
        check(self.memory_budget is None, "memory_budget", self.memory_budget, "left out with --pipeline",
              "A stage holds part of the model; choose the stage count (pipeline stages=S) to fit it.")
        check(isinstance(self.comm, CodecSpec), "compression", self.compression,
              "a thinwire codec (none, bf16, int8, topk:ratio=...) with --pipeline", off)
        check(self.sync_spec.mode in ("allreduce", "local", "diloco") and self.sync_spec.delay == 0, "sync", self.sync,
              "allreduce, local:period=H or diloco:period=H (without delay) with --pipeline", off)
        check(self.partition_spec.kind == "iid", "partition", self.partition, "iid with --pipeline", off)

    def _check_counts(self) -> None:
        for name, lo, hi in _COUNTS:
            check_range(name, getattr(self, name), lo, hi, kind="an integer")
        check_range("nproc", self.nproc, 1, MAX_WORKERS, kind="an integer", fix="Use --nproc 1 for a single process.")
        check(self.cluster is None or self.nproc == 1, "nproc", self.nproc, "left out with --cluster SPEC",
              "Each of the spec's hosts runs one worker: add or remove hosts in the spec to change the world size.")
        check_range("threads", self.threads, 1, MAX_THREADS, kind="an integer",
                    fix="Leave it out to share this machine's cores among the workers.")
        check_range("min_hosts", self.min_hosts, 1, MAX_WORKERS, kind="an integer",
                    fix="Leave it out to stop the run when any host fails.")
        if self.min_hosts is not None:
            check(self.cluster is not None, "min_hosts", self.min_hosts, "used with --cluster SPEC",
                  "On real nodes pass --nnodes MIN:MAX to torchrun yourself (see `thinwire train --help`).")
            check(self.plan is None, "min_hosts", self.min_hosts, "left out with --plan",
                  "A plan fixes its hosts and their shares; train without --plan to let hosts leave and join.")
            check(self.max_restarts >= 1, "max_restarts", self.max_restarts, "at least 1 with min_hosts",
                  "Every host that leaves restarts the workers once: set --max-restarts to the departures to survive.")
        check_range("seed", self.seed, 0, MAX_SEED, kind="an integer",
                    fix="Seeds must fit 32 bits (NumPy's limit; torch seeds are derived from it).")

    def _check_numbers(self) -> None:
        check_range("lr", self.lr, 0, 10, open_lo=True)
        check_range("weight_decay", self.weight_decay, 0, 10)
        check_range("grad_clip", self.grad_clip, 0, 1e9, open_lo=True)
        check_range("bucket_mb", self.bucket_mb, 0, 4096, open_lo=True)
        check_range("timeout_s", self.timeout_s, 1, MAX_TIMEOUT_S, fix="Seconds; 604800 is a week.")


def _offload_core(value: str) -> int | None:
    m = re.fullmatch(r"core:(\d{1,4})", str(value))
    check(value in ("auto", "off") or m is not None, "offload", value,
          "auto, off or core:N (a core of this machine for the communication threads, e.g. core:3)",
          "auto uses a cluster spec's `nic:` engine where there is one.")
    return int(m.group(1)) if m else None


MAX_STEPS = 10**12      # counts beyond this are typos (a step a microsecond for ten days)
MAX_WORKERS = 4096
MAX_THREADS = 1024
MAX_SEED = 2**32 - 1
MAX_TIMEOUT_S = 7 * 24 * 3600.0
_COUNTS = (  # (field, smallest, largest); None (the workload's default) passes
    ("steps", 1, MAX_STEPS), ("batch_size", 1, 10**9), ("warmup_steps", 0, MAX_STEPS),
    ("eval_every", 1, MAX_STEPS), ("eval_batches", 0, 10**9), ("log_every", 1, MAX_STEPS), ("checkpoint_every", 1, MAX_STEPS),
    ("keep_checkpoints", 1, 10**6), ("max_restarts", 0, 10**6), ("compression_warmup", 0, MAX_STEPS),
)


def _check_size(name: str, value: str) -> None:
    from thinwire.units import parse_size

    try:
        parse_size(value, name)
    except ConfigError:
        raise ConfigError(name, value, "a positive size such as 512MiB, 1.5GiB or 800MB (at most 1048576TiB)",
                          "Units: B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000).") from None


def parse_override(item: str) -> tuple[list[str], object]:
    """``"model.width=256"`` -> (["model", "width"], 256); the value is read as YAML 1.2 by
    :func:`~thinwire.config.parse_value` (``1e-3`` a number, ``1:30`` and ``off`` strings)."""
    key, sep, raw = item.partition("=")
    keys = [k.strip() for k in key.split(".")]
    if not sep or not all(keys):
        raise ConfigError("--set", item, "KEY=VALUE (e.g. model.width=256)")
    return keys, parse_value(raw, what=f"--set {key.strip()}")


def load_train_config(path: str | dict | None, overrides: dict, sets: list[str]) -> TrainConfig:
    """File (if any; or the fields themselves, as a checkpoint holds them) < ``--set KEY=VALUE`` < explicit
    flags; then type and range checks."""
    data = dict(path) if isinstance(path, dict) else load_yaml(path) if path else {}
    if isinstance(path, (str, Path)) and path and not data:  # a blank or cut file ran every default without a word
        raise ConfigError(f"config file {str(path)!r}", "a file without fields", "a mapping of field: value",
                          "Write the fields to set (e.g. workload: charlm), or leave --config out for every default")
    flags = {k: v for k, v in overrides.items() if v is not None}
    for item in sets:
        keys, value = parse_override(item)
        if len(keys) == 1 and keys[0] in flags and flags[keys[0]] != value:  # the flag wins: say so, not in silence
            print(f"thinwire: note: --set {item} is overridden by the flag --{keys[0].replace('_', '-')} "
                  f"{flags[keys[0]]}", file=sys.stderr, flush=True)
        node = data
        for i, k in enumerate(keys[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                where = f" (config file {str(path)!r} sets {'.'.join(keys[:i + 1])} to {node!r})" \
                    if isinstance(path, (str, Path)) else ""
                raise ConfigError(".".join(keys), value, "a key under a mapping" + where)
        node[keys[-1]] = value
    in_file = dict(data)
    data.update(flags)
    try:
        return from_dict(TrainConfig, data, where="")
    except ConfigError as e:
        if isinstance(path, (str, Path)) and _from_file(e, in_file, flags, sets):  # the value came from the file
            fix = f"{e.fix.rstrip('.')}. " if e.fix else ""
            raise ConfigError(e.field, e.value, e.allowed, f"{fix}It is in config file {str(path)!r}.") from None
        raise


def _from_file(e: ConfigError, in_file: dict, flags: dict, sets: list[str]) -> bool:
    """Whether the field ``e`` names came from the config file, not from a flag or ``--set``. A codec's or sync
    mode's own parameter (``int8.block``) is no key of the config: it came from the file where its spec did
    (``compression: int8:block=7`` there, no --compression here)."""
    top = re.split(r"[.\[ ]", str(e.field))[0]  # "int8 parameter" (a codec's unknown key) names its codec
    given = {**flags, **{parse_override(item)[0][0]: parse_override(item)[1] for item in sets}}
    if top in {f.name for f in dataclasses.fields(TrainConfig)} or top in in_file:  # an unknown key of the file's
        return top not in given

    def names(values) -> bool:
        return any(isinstance(v, str) and re.match(rf"(\w+@)?{re.escape(top)}\b", v) for v in values)

    return names(in_file.values()) and not names(given.values())


def save_config(cfg: TrainConfig, path: Path) -> None:
    save_yaml(cfg, path)
