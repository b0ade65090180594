"""The training run's config: one typed dataclass, loaded from YAML with CLI overrides.

Only the trainer reads this. Components own their own sections: ``model:`` is validated by the
workload's config (``CharLMConfig``, ``DigitsConfig``), ``compression`` by the codec registry.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import yaml

from thinwire.config import check, from_dict, load_yaml
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
    log_every: int = 1
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    nproc: int = 1
    max_restarts: int = 0
    threads: int | None = None          # torch threads per worker; None: cores / local workers
    compression: str = "none"
    error_feedback: bool = True
    # steps sent uncompressed before the codec starts: Adam's moment estimates start from true
    # gradients (without it PowerSGD from step 0 ends a short charlm run ~2% higher); 2 is also the
    # earliest PyTorch's PowerSGD hook may start
    compression_warmup: int = 2
    bucket_mb: float = 25.0             # DDP bucket cap
    timeout_s: float = 300.0            # a collective stuck this long (dead peer, cut link) fails the run
    precision: Literal["fp32", "bf16", "fp16", "int8", "auto"] = "fp32"
    memory_budget: str | None = None    # e.g. "512MiB": largest micro-batch that fits, accumulated to batch_size
    out: str | None = None
    resume: str | None = None
    cluster: str | None = None
    plan: str | None = None             # a plan file from `thinwire plan` (needs cluster)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            v = getattr(self, name)
            check(v is None or v >= 1, name, v, "an integer >= 1")
        check(self.lr is None or self.lr > 0, "lr", self.lr, "a number > 0")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        check(self.grad_clip is None or self.grad_clip > 0, "grad_clip", self.grad_clip, "a number > 0 or null")
        check(self.eval_every >= 1, "eval_every", self.eval_every, "an integer >= 1")
        check(self.log_every >= 1, "log_every", self.log_every, "an integer >= 1")
        check(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every, "an integer >= 1")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints, "an integer >= 1")
        check(self.nproc >= 1, "nproc", self.nproc, "an integer >= 1", "Use --nproc 1 for a single process.")
        check(self.max_restarts >= 0, "max_restarts", self.max_restarts, "an integer >= 0")
        check(self.threads is None or self.threads >= 1, "threads", self.threads, "an integer >= 1 or null")
        check(self.compression_warmup >= 0, "compression_warmup", self.compression_warmup, "an integer >= 0")
        check(0 < self.bucket_mb <= 4096, "bucket_mb", self.bucket_mb, "a number in (0, 4096]")
        check(self.timeout_s >= 1, "timeout_s", self.timeout_s, "a number of seconds >= 1")
        check(self.data is None or self.data.strip() != "", "data", self.data,
              "a path to a text file or folder", "Leave --data out to use the default corpus.")
        if self.memory_budget is not None:
            _check_size("memory_budget", self.memory_budget)


def _check_size(name: str, value: str) -> None:
    from thinwire.precision.memory import parse_size

    try:
        ok = parse_size(value) > 0
    except ValueError:
        ok = False
    check(ok, name, value, "a positive size such as 512MiB, 1.5GiB or 800MB",
          "Units: B, KiB, MiB, GiB (powers of 1024) or KB, MB, GB (powers of 1000).")


def parse_override(item: str) -> tuple[list[str], object]:
    """``"model.width=256"`` -> (["model", "width"], 256); the value is read as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError("--set", item, "KEY=VALUE (e.g. model.width=256)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def load_train_config(path: str | None, overrides: dict, sets: list[str]) -> TrainConfig:
    """File (if any) < ``--set KEY=VALUE`` < explicit flags; then type and range checks."""
    data = load_yaml(path) if path else {}
    for item in sets:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(keys), value, "a key under a mapping")
        node[keys[-1]] = value
    data.update({k: v for k, v in overrides.items() if v is not None})
    return from_dict(TrainConfig, data, where="")


def save_config(cfg: TrainConfig, path: Path) -> None:
    from thinwire.config import to_dict

    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
