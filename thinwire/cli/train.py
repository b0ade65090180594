"""``thinwire train``: resolve and check the config, pick the run folder, then run or launch workers."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import sys
from pathlib import Path

from thinwire.cli.common import COMMANDS
from thinwire.config import check_writable
from thinwire.errors import ConfigError, ThinwireError
from thinwire.train import runfolder
from thinwire.train.config import TrainConfig, load_train_config, save_config

EPILOG = """examples:
  thinwire train                                   # charlm on the Python standard library, 1 process
  thinwire train --nproc 2 --compression int8      # 2 local workers, int8 gradients on the wire
  thinwire train --nproc 2 --compression int8 --sync delayed           # averaging overlaps the next step
  thinwire train --nproc 2 --compression int8 --sync diloco:period=100  # DiLoCo: average every 100 steps
  thinwire train --nproc 4 --pipeline 1f1b:stages=4  # the model cut into 4 stages, one per worker
  thinwire train --workload digits --steps 300 --out runs/digits
  thinwire train --resume runs/digits --steps 600  # continue a run where it stopped (LR horizon kept)
  thinwire train --resume runs/digits --steps 600 --reschedule  # ... with the LR schedule fit to 600 steps
  thinwire train --workload mypkg.mod:make --set model.width=64
multi-node (run on every node; rank 0 writes the run folder):
  torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
           --rdzv-id myjob --max-restarts 1 -m thinwire train --config run.yaml --out /shared/run1
"""


def add_parser(sub) -> None:
    p = sub.add_parser("train", help=COMMANDS["train"],
                       epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file of TrainConfig fields (flags override it)")
    p.add_argument("--workload", help="charlm, digits, or package.module:function")
    p.add_argument("--data", help="text file or folder for charlm (default: the Python standard library)")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int, help="global batch per step, split evenly across workers")
    p.add_argument("--lr", type=float)
    p.add_argument("--reschedule", action=argparse.BooleanOptionalAction, default=None,
                   help="on --resume with other --steps: fit the LR schedule to the new total (default: keep the "
                        "horizon of the run's first start)")
    p.add_argument("--nproc", type=int, help="local worker processes (default 1)")
    p.add_argument("--max-restarts", type=int, help="restart all workers up to K times after a failure")
    p.add_argument("--min-hosts", type=int, help="with --cluster: go on while at least this many hosts are left; "
                   "a host that leaves is dropped at the next rendezvous, one that comes back joins "
                   "(torchrun --nnodes MIN:MAX); needs --max-restarts >= the departures to survive")
    p.add_argument("--out", help="run folder (default: runs/WORKLOAD-TIMESTAMP)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint")
    p.add_argument("--compression", help="codec spec (int8, topk:ratio=0.01, powersgd:rank=4), auto, or "
                   "torch:none|fp16|bf16|powersgd:rank=R|localsgd:period=H (PyTorch's own hooks); see `thinwire codecs`")
    p.add_argument("--sync", metavar="MODE", help="when averaging happens: allreduce (default), "
                   "auto[:trial=N,guard=PROFILE] (allreduce or delayed, by this run's clock; never delayed where the profile's guard says it costs loss), "
                   "delayed[:predict=own|last|off], local:period=H[,warmup=W], diloco:period=H[,outer_lr=0.7,outer_momentum=0.9] "
                   "(either streamed: fragments=F[,delay=1,alpha=0.5]), gossip[:topology=exp2|ring|torus|random,gamma=G,"
                   "overlap=1], dynamic[:threshold=D,check_every=B,rule=drift|spread,by_lr=1]; see README, Sync modes")
    p.add_argument("--pipeline", metavar="SCHEDULE", help="cut the model into stages on different workers: "
                   "gpipe, 1f1b or interleaved[:stages=S,microbatches=M,layers=A/B/..,activations=F,virtual=V,"
                   "recompute=on] "
                   "(default none); workers = replicas x stages")
    p.add_argument("--partition", help="which training items each worker draws from: iid (default), "
                   "label_skew:alpha=A (Dirichlet class skew, classification) or by_file (an equal, contiguous run each: for charlm, different files)")
    p.add_argument("--precision", help="fp32, bf16, fp16, int8 (int8 matmuls, Mandheling-style) or auto")
    p.add_argument("--memory-budget", help="e.g. 512MiB: largest micro-batch whose step's live tensors fit, "
                   "accumulated to --batch-size (the process itself, ~250 MiB on a CPU, is not counted)")
    p.add_argument("--seed", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--log-every", type=int)
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="also write loss, step-time breakdown, bytes, validation and auto's decisions as TensorBoard "
                        "event files under OUT/tensorboard (needs `pip install 'thinwire[tensorboard]'`)")
    p.add_argument("--threads", type=int, help="torch threads per worker")
    p.add_argument("--cluster", help="cluster spec: one worker per emulated host (needs `thinwire cluster up`)")
    p.add_argument("--plan", help="execute a plan from `thinwire plan` (uneven shares, codecs, grouping); needs --cluster")
    p.add_argument("--aggregation", choices=["ring", "switch"], help="with --cluster and --compression int8: switch "
                   "sums the buckets in the aggregator on the cluster's switch (spec `switch:`) instead of around the "
                   "ring (default ring); with --compression auto, auto chooses per bucket between the two")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config field, e.g. --set model.width=256 (repeatable)")
    p.set_defaults(func=run)


FLAGS = ("workload", "data", "steps", "batch_size", "lr", "reschedule", "nproc", "max_restarts", "min_hosts", "out", "resume", "compression", "sync",
         "partition", "pipeline",
         "precision", "memory_budget", "seed", "eval_every", "checkpoint_every", "log_every", "threads", "cluster",
         "plan", "tensorboard", "aggregation")


def run(args: argparse.Namespace) -> int:
    from thinwire.train import checkpoint as ckpt
    from thinwire.train.distenv import read_env

    cfg = resolve_config(args)
    env = read_env()
    if env.launched:  # under the user's torchrun: this process is a worker
        return _train_as_worker(cfg, env)
    existed = Path(cfg.out).exists()
    try:
        fresh = not existed or (Path(cfg.out).is_dir() and not any(Path(cfg.out).iterdir()))
    except OSError:  # preflight names what is wrong with the folder
        fresh = False
    folder = preflight(cfg, runfolder.new_run_id())
    config = Path(cfg.out) / "config.yaml"
    kept = config.read_bytes() if config.is_file() else None  # a resume in place: its config until a step lands
    last = ckpt.latest(Path(cfg.out))
    _prepare(cfg, folder)

    def keep_config() -> bool:
        """Before a checkpoint of the new configuration (refused by the workers, stopped, or a resume with nothing
        to train) the run's folder stays as it was, its config.yaml included: a plain --resume goes on as before."""
        if kept is None or ckpt.latest(Path(cfg.out)) != last:
            return False
        tmp = config.with_name(config.name + ".tmp")
        tmp.write_bytes(kept)
        os.replace(tmp, config)
        return True

    try:
        if cfg.cluster:
            from thinwire.train.cluster_launch import launch_cluster

            launch_cluster(cfg, config)
            code = 0
        elif cfg.nproc == 1 and cfg.max_restarts == 0:
            code = _train_here(cfg)
        else:
            from thinwire.train.launch import launch_local

            launch_local(cfg, config)  # this process keeps the folder's lock while they run
            code = 0
        keep_config()
        return code
    except BaseException:
        if not keep_config() and fresh:
            _unclaim(Path(cfg.out), remove=not existed)
        raise


def _unclaim(out: Path, *, remove: bool) -> None:
    """A new run refused before its first record (a memory budget no micro-batch fits, found in the worker; a model
    that fails on the first batch) leaves no half-made run: its marker, config.yaml and start events go, and the folder (``remove``: it made it) if nothing
    else is in it (``hosts/``, a cluster's logs that explain the failure, stays)."""
    try:
        if set(os.listdir(out)) - {runfolder.MARKER, "config.yaml", "metrics.jsonl"} or not _no_records(out):
            return
        for name in ("metrics.jsonl", "config.yaml", runfolder.MARKER):
            (out / name).unlink(missing_ok=True)
        if remove:
            out.rmdir()
    except OSError:
        pass


def _no_records(out: Path) -> bool:
    """Whether the run's metrics.jsonl, if any, holds only its workers' start events (no step trained)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return True
    try:
        if path.stat().st_size > 1 << 16:
            return False
        return all(json.loads(line).get("event") == "start" for line in path.read_text().splitlines() if line.strip())
    except (OSError, ValueError, AttributeError):
        return False


def _train_as_worker(cfg: TrainConfig, env) -> int:
    """Rank 0 writes the run folder, so it runs the same checks as the CLI's own launch, at every (re)start."""
    from thinwire.signals import stop_when_orphaned

    stop_when_orphaned()  # the user's torchrun killed: this worker stops too
    if env.rank == 0:
        _prepare(cfg, preflight(cfg, runfolder.torchrun_run_id(), world=env.world))
    from thinwire.train.worker import leave, leave_if_lost_peer

    try:
        code = _train_here(cfg)
    except RuntimeError as e:  # a lost peer: one line, as `thinwire train`'s own workers say it
        leave_if_lost_peer(e, env.rank)
        raise
    leave(code)  # past gloo's static destructors, which can abort at exit and fail a finished run
    return code


def _config_of_checkpoint(folder: Path) -> dict | None:
    """The config a run's latest checkpoint was written with: for a folder whose config.yaml is gone (only its
    checkpoints copied to another machine)."""
    from thinwire.train import checkpoint as ckpt

    last = ckpt.latest(folder)
    if last is None:
        return None
    print(f"thinwire: note: {folder} has no config.yaml; resuming with the configuration saved in {last.name}",
          file=sys.stderr, flush=True)
    return ckpt.load(last)["config"]


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    overrides = {k: getattr(args, k) for k in FLAGS}
    for item in args.set or []:  # a resume reads the run's own config first: only the flag can say which run
        if item.partition("=")[0].strip() == "resume":
            raise ConfigError("--set resume", item.partition("=")[2], "given as the flag --resume DIR, not with --set",
                              f"Use --resume {item.partition('=')[2] or 'DIR'}: it reads that run's own config.yaml "
                              "and goes on in its folder.")
    base = args.config
    if args.resume and Path(args.resume).exists() and not Path(args.resume).is_dir():
        raise ThinwireError(f"resume: {args.resume!r} is a file, not a run folder. Pass the --out folder of an earlier "
                            "run (it holds config.yaml and checkpoints/).")
    if args.resume and not base:  # continue with the resumed run's own config unless told otherwise
        saved = Path(args.resume) / "config.yaml"
        base = str(saved) if saved.is_file() else _config_of_checkpoint(Path(args.resume))
    elif base:
        base = _on_resumed_run(args, base)
    if args.resume and args.workload and base:
        _same_workload(args, base)
    cfg = load_train_config(base, overrides, args.set)
    # a path written ~/... in a config file or --set (the shell expands only the flags' own)
    cfg = dataclasses.replace(cfg, **{k: os.path.expanduser(v) for k in ("out", "cluster", "plan", "data")
                                      if isinstance(v := getattr(cfg, k), str) and v.startswith("~")})
    # the files a run names, absolute in its config.yaml: a --resume from another folder finds them
    cfg = dataclasses.replace(cfg, **{k: str(Path(v).resolve()) for k in ("cluster", "plan", "data", "resume")
                                      if (v := getattr(cfg, k)) and Path(v).exists()},
                              **{k: _absolute_guard(v) for k in ("sync", "compression")
                                 if isinstance(v := getattr(cfg, k), str) and "guard=" in v})
    if args.resume and not _out_given(args):
        cfg = dataclasses.replace(cfg, out=args.resume)
    if cfg.plan:
        cfg = _pipeline_from_plan(cfg)
    if not cfg.out:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg = dataclasses.replace(cfg, out=str(_free_folder(Path("runs") / f"{cfg.workload.replace(':', '.')}-{stamp}")))
    return cfg


def _free_folder(path: Path) -> Path:
    """The default run folder, or NAME-2, NAME-3, ... where a run started in the same second holds it (two runs
    started together must not refuse each other's folder)."""
    n = 2
    out = path
    while out.exists():
        out, n = path.with_name(f"{path.name}-{n}"), n + 1
    return out


def _same_workload(args: argparse.Namespace, base: str | dict) -> None:
    """A resumed run keeps its workload: another one's options and checkpoint do not fit it (the error would
    otherwise name a model option of the run's config that the user never gave)."""
    from thinwire.config import load_yaml

    data = base if isinstance(base, dict) else load_yaml(Path(base))
    was = data.get("workload") if isinstance(data, dict) else None
    if isinstance(was, str) and was != args.workload:
        raise ThinwireError(f"workload: run {args.resume} trains {was}; --workload {args.workload} cannot change on "
                            f"--resume (its checkpoint holds {was}'s parameters). Leave --workload out to go on, or "
                            f"start a new run: thinwire train --workload {args.workload} --out NEW_FOLDER.")


def _on_resumed_run(args: argparse.Namespace, path: str) -> str | dict:
    """A config file that resumes a run (``--resume DIR --config FILE``, or ``resume:`` in FILE): FILE's keys
    on top of the resumed run's own config, as ``--set`` and flags go on top of it; a file that leaves out the
    model's options must not train the workload's defaults against the run's checkpoint."""
    from thinwire.config import load_yaml

    data = load_yaml(Path(path))
    if not isinstance(data, dict):
        return path  # load_train_config says what is wrong with it
    resume = args.resume or data.get("resume")
    if not isinstance(resume, str) or not Path(resume).expanduser().is_dir():
        return path
    folder = Path(resume).expanduser()
    saved = folder / "config.yaml"
    run = load_yaml(saved) if saved.is_file() else _config_of_checkpoint(folder)
    if not isinstance(run, dict):
        return path
    if not args.resume:  # the file resumes: say so, a file copied from a resumed run's folder keeps its resume:
        print(f"thinwire: note: {path} says resume: {resume}; this run goes on from that run's latest checkpoint "
              "with its configuration under the file's keys (delete the resume: line to start afresh)",
              file=sys.stderr, flush=True)
    merged = dict(run)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _out_given(args: argparse.Namespace) -> bool:
    """Whether the user named the run folder (``--out``, ``--set out=``, ``out:`` in ``--config``): a resume
    then writes there; else it goes on in the folder it resumes."""
    if args.out or any(item.partition("=")[0].strip() == "out" for item in args.set or []):
        return True
    if args.config:
        from thinwire.config import load_yaml

        data = load_yaml(Path(args.config))
        return isinstance(data, dict) and data.get("out") is not None
    return False


def _pipeline_from_plan(cfg: TrainConfig) -> TrainConfig:
    """A pipeline plan runs as ``--pipeline`` with the plan's layout (the plan also orders ranks by host)."""
    from thinwire.plan.planfile import read_plan

    plan = read_plan(cfg.plan)
    if plan.pipeline is None:
        if cfg.pipeline_spec.enabled:
            raise ConfigError("pipeline", cfg.pipeline, "none with a data-parallel --plan",
                              "Make a pipeline plan with `thinwire plan --pipeline`, or leave --pipeline out.")
        if plan.chosen is not None and plan.chosen.collective == "switch":  # the aggregator on the switch sums int8
            return dataclasses.replace(cfg, aggregation="switch")
        if cfg.aggregation == "switch":
            raise ConfigError("aggregation", cfg.aggregation, f"ring with a plan whose collective is "
                              f"{plan.chosen.collective if plan.chosen else 'none'}",
                              "The plan priced no switch; `thinwire plan` on a cluster spec with `switch:` prices it.")
        return cfg
    return dataclasses.replace(cfg, pipeline=plan.pipeline.spec_text())


def preflight(cfg: TrainConfig, run_id: str, world: int | None = None) -> runfolder.RunFolder:
    """Every check that can fail before a worker starts, so bad input never leaves half a run.

    Returns the run folder, checked and locked for ``run_id`` but not yet written (see
    :mod:`thinwire.train.runfolder`)."""
    from thinwire.train.loop import resolve
    from thinwire.train.metrics import check_tensorboard
    from thinwire.workloads.registry import build_workload, check_workload_name

    check_workload_name(cfg.workload)
    if cfg.resume and not Path(cfg.resume).exists():  # before the notes on the schedule: nothing runs
        raise ThinwireError(f"resume: {cfg.resume!r} does not exist. Pass the --out folder of an earlier run.")
    check_writable(cfg.out or "runs", "out", folder=True)  # the default run folder goes under runs/
    _check_compression(cfg)
    if cfg.offload_core is not None:  # a core of this machine: workers (and emulated hosts) run here
        from thinwire.compress.engine import check_core

        check_core(cfg.offload_core)
    if cfg.tensorboard:
        check_tensorboard()
    if not cfg.cluster and world is None:  # local workers (an emulated cluster's hosts run on the CPU)
        from thinwire.train.distenv import check_gpus

        check_gpus(_world_size(cfg))
    import torch

    torch.manual_seed(cfg.seed)  # as every worker builds it (a workload that draws builds the same data here)
    wl = build_workload(cfg.workload, cfg.model, cfg.data)
    steps, batch, _ = resolve(cfg, wl)
    _check_fragments(cfg, wl.model)
    _check_budget_holds_the_model(cfg, wl.model)
    sync = cfg.sync_spec
    if sync.mode in ("local", "diloco") and sync.warmup >= steps and world is None:
        print(f"thinwire: note: --sync {sync.text}: all {steps} steps are its synchronous warm-up (warmup="
              f"{sync.warmup}), so every step averages gradients as allreduce does and no step is local; give "
              f"warmup={max(0, steps // 10)} or less to train locally", file=sys.stderr, flush=True)
    elif sync.mode in ("local", "diloco") and steps - sync.warmup < sync.sync_every and world is None:
        print(f"thinwire: note: --sync {sync.text}: the run has {steps - sync.warmup} local step(s) and its first "
              f"average comes after {sync.sync_every}, so the ranks never average while training (only "
              "validation evaluates their average); give a smaller period or more --steps", file=sys.stderr, flush=True)
    if sync.mode == "auto" and steps < sync.warmup + 2 * sync.trial and world is None:
        print(f"thinwire: note: --sync {sync.text}: it chooses after {sync.warmup} warm-up steps and {sync.trial} "
              f"timed steps of each mode ({sync.warmup + 2 * sync.trial} in all), and the run has {steps}: it ends "
              f"before choosing; give a smaller trial= (at least 5) or more --steps", file=sys.stderr, flush=True)
    if cfg.warmup_steps >= steps and world is None:
        print(f"thinwire: note: warmup_steps={cfg.warmup_steps} is not below --steps {steps}: the learning rate rises "
              f"to {steps / max(1, cfg.warmup_steps):.2g}x its peak at most and never decays; --set warmup_steps="
              f"{steps // 10} gives the whole schedule", file=sys.stderr, flush=True)
    _small_model_note(cfg, wl.model, world)
    _check_guards(cfg)
    # every world size the run may meet: hosts may leave down to min_hosts
    if cfg.plan:  # first: a plan for another workload or cluster says so, not what its layout does not fit
        _check_plan(cfg)
    if cfg.min_hosts and world is None and cfg.min_hosts > (hosts := _world_size(cfg)):
        raise ConfigError("min_hosts", cfg.min_hosts, f"at most the {hosts} hosts of {cfg.cluster}",
                          "Lower --min-hosts (the hosts the run needs to go on when others leave), or add hosts to the spec.")
    worlds = [world] if world else list(range(cfg.min_hosts or _world_size(cfg), _world_size(cfg) + 1))
    for w in worlds:
        if cfg.sync_spec.mode == "gossip":
            from thinwire.compress.sync.gossip import check_topology

            try:
                check_topology(cfg.sync_spec.topology, w)
            except ConfigError as e:
                if len(worlds) == 1:
                    raise
                raise ConfigError(e.field, e.value, f"{e.allowed}, which the run may have (min_hosts {cfg.min_hosts})",
                                  f"{e.fix} Raise --min-hosts to {worlds[-1]}, or choose ring or exp2.") from None
        if cfg.partition_spec.kind != "iid":  # a split that cannot be made (a class skew of a language model) fails here
            from thinwire.workloads.partition import shards

            shards(cfg.partition_spec, wl.train, w, cfg.seed, wl.task)
            files = (wl.info or {}).get("corpus_files")
            if cfg.partition_spec.kind == "by_file" and files is not None and files < w and w == worlds[-1]:
                print(f"thinwire: note: --partition by_file: the corpus has {files} file(s) for {w} workers, so some "
                      "workers train on parts of the same file (each gets an equal, contiguous share)",
                      file=sys.stderr, flush=True)
        if cfg.pipeline_spec.enabled:
            _check_pipeline(cfg, wl, batch, w)
        elif not cfg.plan:
            _check_batch(cfg, batch, w, worlds)
    info = wl.info or {}
    if info.get("corpus_capped") and cfg.data:
        print(f"thinwire: note: --data: charlm reads the first {info['corpus_bytes']:,} bytes (model.max_bytes) of "
              f"{info.get('corpus_files_found')} file(s), in order of their names: {info['corpus_files']} of them; "
              "raise model.max_bytes to train on more", file=sys.stderr, flush=True)
    if cfg.cluster and world is None:  # before the folder is written: the cluster is up, and no other job is on it
        from thinwire.train.cluster_launch import check_free

        check_free(cfg.cluster)
    folder = runfolder.RunFolder(cfg, run_id)
    if cfg.resume:
        _check_resume(cfg, wl)
    return folder


def _check_batch(cfg: TrainConfig, batch: int, world: int, worlds: list[int]) -> None:
    from thinwire.train.loop import check_batch

    if len(worlds) == 1:
        return check_batch(batch, world)
    if batch % world:
        lcm = math.lcm(*worlds)
        raise ConfigError("batch_size", batch, f"divisible by every number of hosts the run may have "
                          f"({worlds[0]} to {worlds[-1]} with min_hosts {cfg.min_hosts})",
                          f"Use a multiple of {lcm}, e.g. {max(lcm, batch // lcm * lcm)}.")


def _check_pipeline(cfg: TrainConfig, wl, batch: int, world: int) -> None:
    """The model has a layer list that chains, and the world size, batch and micro-batches make a layout."""
    from thinwire.pipeline.layout import layout_of
    from thinwire.pipeline.stages import check_chain, layer_list
    from thinwire.workloads.base import collate

    layers = layer_list(wl.model, wl.layers, cfg.workload)
    lay = layout_of(cfg.pipeline_spec, layers, world, batch)
    check_chain(layers, collate(wl.train, [0])[0], lay.runs, lay.links, model=wl.model)
    if cfg.sync_spec.periodic and cfg.sync_spec.fragments > 1:  # each rank fragments its own stage(s)
        for rank in range(lay.stages):
            params = {id(p): p for k, run in enumerate(lay.runs) if k % lay.stages == rank
                      for i in run for p in layers[i].module.parameters()}
            tensors = sum(p.requires_grad for p in params.values())
            if cfg.sync_spec.fragments > tensors:
                names = ", ".join(layers[i].name for k, run in enumerate(lay.runs) if k % lay.stages == rank for i in run)
                raise ConfigError("sync.fragments", cfg.sync_spec.fragments,
                                  f"at most {tensors}, the trainable parameter tensors of pipeline stage {rank} "
                                  f"({names})", "Each stage splits its own parameters into the fragments, whole "
                                  "tensors each: give fewer fragments or fewer stages.")


def _check_fragments(cfg: TrainConfig, model) -> None:
    """A streamed average (local or DiLoCo) splits whole parameter tensors: no more fragments than the model has."""
    tensors = sum(p.requires_grad for p in model.parameters())
    if cfg.sync_spec.fragments > tensors:
        raise ConfigError("sync.fragments", cfg.sync_spec.fragments, f"at most {tensors}, the model's trainable "
                          "parameter tensors", "A fragment holds whole parameter tensors.")


def _small_model_note(cfg: TrainConfig, model, world: int | None) -> None:
    """A lossy codec on a model whose every bucket stays under the hook's ``min_compress_bytes``: nothing is ever
    compressed (too small for it to pay), which the summary's ``compression`` alone would not tell."""
    from thinwire.commspec import CodecSpec
    from thinwire.compress.hook import MIN_COMPRESS_BYTES

    if world is not None or not isinstance(cfg.comm, CodecSpec) or cfg.comm.codec.lossless:
        return
    if cfg.sync_spec.mode == "gossip":  # gossip sends every parameter through the codec, whatever its size
        return
    size = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    if size < MIN_COMPRESS_BYTES:
        print(f"thinwire: note: --compression {cfg.comm.text}: the model's trainable parameters take {size:,} bytes, "
              f"under the {MIN_COMPRESS_BYTES:,} below which a bucket travels uncompressed, so every average goes "
              "in fp32 (`counts` in the summary's compression stats says so); a codec pays only on larger models",
              file=sys.stderr, flush=True)


def _check_compression(cfg: TrainConfig) -> None:
    """The spec was parsed with the config; building its policy checks what only the policy knows."""
    from thinwire.commspec import TorchSpec

    if not isinstance(cfg.comm, TorchSpec):
        cfg.comm.policy()


def _check_plan(cfg: TrainConfig) -> None:
    from thinwire.cluster.spec import load_cluster_spec
    from thinwire.plan.planfile import load_plan

    if not cfg.cluster:
        raise ThinwireError("plan: --plan needs --cluster SPEC, the cluster the plan was made for.")
    spec = load_cluster_spec(cfg.cluster)
    plan = load_plan(cfg.plan, spec, cfg.workload, cfg.model, batch_size=cfg.batch_size)
    if plan.chosen is not None and plan.chosen.collective == "switch" and spec.switch is None:
        raise ThinwireError(f"plan: {cfg.plan} sends int8 through the switch's aggregator, and {cfg.cluster} has no "
                            "`switch:`. Use the cluster spec the plan was made for, or plan again on this one.")
    if plan.pipeline is None:
        plan.shares(len(plan.hosts))  # refuses a plan that is not executable
    note = validation_mismatch(plan.planning.get("validation"), cfg)
    if note:
        print(f"thinwire: note: {note}", file=sys.stderr, flush=True)


def validation_mismatch(priced: dict | None, cfg: TrainConfig) -> str | None:
    """A note when the plan priced another validation cadence than this run's (its ranking counted it)."""
    if not priced or not priced.get("every"):
        return None
    if (priced["every"], priced["batches"]) == (cfg.eval_every, cfg.eval_batches):
        return None
    return (f"the plan counted a validation every {priced['every']} steps on {priced['batches'] or 'all'} global batches; "
            f"this run validates every {cfg.eval_every} steps on {cfg.eval_batches or 'all'}. Its choice may not be the "
            f"fastest to the target for this run: `thinwire plan ... --eval-every {cfg.eval_every} --eval-batches "
            f"{cfg.eval_batches}` plans for it.")


def _world_size(cfg: TrainConfig) -> int:
    if cfg.plan and cfg.pipeline_spec.enabled:  # a pipeline plan launches its stages' hosts only
        from thinwire.plan.planfile import read_plan

        return len(read_plan(cfg.plan).hosts)
    if cfg.cluster:
        from thinwire.cluster.spec import load_cluster_spec

        return len(load_cluster_spec(cfg.cluster).hosts)
    return cfg.nproc


def _check_guards(cfg: TrainConfig) -> None:
    """A convergence guard (``auto:guard=PATH`` in --sync or --compression) speaks for the workload it profiled:
    another's verdicts would decide this run by a model it is not."""
    from thinwire.measure.file import load_profile

    for field in ("sync", "compression"):
        for path in re.findall(r"guard=([^,]+)", str(getattr(cfg, field))):
            from thinwire.plan.planfile import normalized_model

            prof = load_profile(path, flag=None)
            if prof.workload != cfg.workload or (normalized_model(cfg.workload, prof.model)
                                                 != normalized_model(cfg.workload, cfg.model)):
                raise ConfigError(f"{field}.guard", path, f"a profile of this run's workload ({cfg.workload!r} with "
                                  f"model options {dict(cfg.model)})", f"it profiles {prof.workload!r} with "
                                  f"{dict(prof.model)}; profile this workload (`thinwire profile --workload "
                                  f"{cfg.workload} ...`) and pass that file")


def _absolute_guard(spec: str) -> str:
    """``auto:guard=PATH`` with PATH absolute where it names a file (as the cluster, plan and data paths)."""
    return re.sub(r"(guard=)([^,]+)", lambda m: m.group(1) + (str(Path(m.group(2)).resolve())
                                                              if Path(m.group(2)).is_file() else m.group(2)), spec)


def _check_budget_holds_the_model(cfg: TrainConfig, model) -> None:
    """A budget below the model's parameters (a byte each, as int8 holds them) cannot fit any step: refused here,
    once, not by every worker at start-up (each restart of ``--max-restarts`` refused it again)."""
    if not cfg.memory_budget or cfg.pipeline != "none" or cfg.plan:  # a stage holds a part of the model
        return
    from thinwire.units import parse_size

    numel = sum(p.numel() for p in model.parameters())
    if parse_size(cfg.memory_budget, "memory_budget") < numel:
        raise ConfigError("memory_budget", cfg.memory_budget, f"at least {numel:,} bytes: the model's {numel:,} "
                          f"parameters take that much even in int8 ({4 * numel / 2**20:.1f} MiB in fp32)",
                          "Raise it, or leave it out to train without a budget")


def _check_resume(cfg: TrainConfig, wl) -> None:
    from thinwire.train import checkpoint as ckpt

    found, where = ckpt.resume_point(Path(cfg.resume))
    if found is not None and where != Path(cfg.resume):
        print(f"thinwire: note: {cfg.resume} holds no checkpoint: its run stopped before its first one, and it had "
              f"gone on from {where}: training goes on from {found}", file=sys.stderr, flush=True)
    if found is None:
        if not ckpt.stopped_before_first(Path(cfg.resume)):
            marker = (Path(cfg.resume) / runfolder.MARKER).is_file()
            raise ThinwireError(f"resume: folder {cfg.resume!r} "
                                + ("holds no checkpoint (checkpoints/step_*.pt). " if marker else
                                   f"is not a thinwire run folder (no {runfolder.MARKER}, no checkpoints/). ")
                                + "Pass the --out folder of an earlier `thinwire train` run.")
        print(f"thinwire: note: {cfg.resume} holds no checkpoint: its run stopped before its first one (every "
              f"{cfg.checkpoint_every} steps), so it trains again from step 0 with its configuration",
              file=sys.stderr, flush=True)
        return
    state = ckpt.load(found)
    ckpt.check_signature(found, state["signature"], ckpt.model_signature(wl.model))
    ckpt.check_shards(found, state)  # a pipeline's stages: found missing here, not in every worker at once


def _prepare(cfg: TrainConfig, folder: runfolder.RunFolder) -> None:
    from thinwire.train import checkpoint as ckpt

    if cfg.resume and Path(cfg.resume).resolve() == folder.out.resolve():
        # resumed in place without a checkpoint of its own: its config keeps naming the run it went on from, which
        # the next resume reads (ckpt.resume_point) before this overwrites it
        found, where = ckpt.resume_point(Path(cfg.resume))
        if found is not None and where.resolve() != folder.out.resolve():
            cfg = dataclasses.replace(cfg, resume=str(where))
    folder.claim()  # the marker first: from here on the folder is this run's
    save_config(cfg, folder.out / "config.yaml")


def _train_here(cfg: TrainConfig) -> int:
    from thinwire.train.loop import train

    train(cfg, Path(cfg.out))
    return 0
