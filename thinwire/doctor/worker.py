"""One ``thinwire doctor`` process: ``python -m thinwire.doctor.worker CONFIG.yaml`` under torchrun's
agent (or the user's torchrun, through ``thinwire doctor`` itself). Every rank measures
(:mod:`.probe`); rank 0 prices and recommends (:mod:`.advise`) and writes ``report.json``."""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # a stop signal while torch loads: out quietly (the launcher says it once)
    from thinwire.signals import leave_quietly_on_stop

    leave_quietly_on_stop()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from thinwire.config import from_dict, load_yaml  # noqa: E402
from thinwire.errors import ThinwireError  # noqa: E402
from thinwire.train.config import TrainConfig  # noqa: E402

REPORT = "report.json"


def diagnose(cfg: TrainConfig, out: Path) -> dict | None:
    """Measure on every rank, advise on rank 0; rank 0 returns the report (written to ``out``)."""
    from thinwire.compress.schemes.switched import switchable, via_switch
    from thinwire.compress.spec import default_candidates
    from thinwire.compress.switch import ENV as SWITCH_ENV
    from thinwire.doctor.advise import advise, job_args
    from thinwire.doctor.probe import allreduce, codec_trials, pairs, step_times
    from thinwire.precision.setup import sample_from
    from thinwire.workloads.base import collate
    from thinwire.measure.run import profile_workload
    from thinwire.train.distenv import device_for, init, read_env, set_threads
    from thinwire.train.loop import check_batch
    from thinwire.workloads.registry import build_workload

    start = time.perf_counter()
    env = read_env()
    device = device_for(env)
    set_threads(env, cfg.threads)
    init(env, device, cfg.timeout_s)
    log = logging.getLogger("thinwire.doctor")
    try:
        torch.manual_seed(cfg.seed)
        wl = build_workload(cfg.workload, cfg.model, cfg.data)
        pristine = copy.deepcopy(wl.model)  # each codec's trial starts from its own copy
        batch = cfg.batch_size or wl.batch_size
        check_batch(batch, env.world)
        per_rank = batch // env.world
        log.info("doctor: %d rank(s); timing the step with and without communication", env.world)
        steps = step_times(wl, device, per_rank, bucket_mb=cfg.bucket_mb, seed=cfg.seed)
        log.info("doctor: probing the all-reduce and every pair of ranks")
        net = allreduce(steps["grad_bytes"], device)
        links = pairs(steps["grad_bytes"], device) if env.world > 1 else []
        codecs = default_candidates()
        # with an aggregator on the switch (`thinwire doctor --cluster SPEC`, spec `switch:`): int8 through it too
        routed = codecs + tuple(via_switch(c) for c in codecs if switchable(c)) if os.environ.get(SWITCH_ENV) else codecs
        log.info("doctor: trying each codec for a few steps: %s", ", ".join(routed))
        batch = sample_from(wl.train, collate, device, cfg.seed + env.rank)(per_rank)
        trials = codec_trials(lambda: copy.deepcopy(pristine), wl.loss, batch, routed, device,
                              bucket_mb=cfg.bucket_mb, timeout_s=cfg.timeout_s) if env.world > 1 else {}
        log.info("doctor: measuring the codecs' costs and the model's buckets")
        # on every rank at once: the profile wraps the model in DDP, whose constructor is a collective
        prof = profile_workload(workload=cfg.workload, model=cfg.model, data=cfg.data, batch_sizes=[per_rank],
                                bucket_mb=cfg.bucket_mb, threads=torch.get_num_threads(), codecs=list(codecs), reps=5,
                                corun=False, guard_steps=0)
        mine = {"rank": env.rank, "host": socket.gethostname(), **steps, "trials": trials}
        ranks: list = [None] * env.world
        dist.all_gather_object(ranks, mine)
        report = None
        if env.rank == 0:
            report = advise(ranks=ranks, network=net, pairs=links, profile=prof, per_rank_batch=per_rank,
                            steals=device.type == "cpu", workload=cfg.workload, codecs=routed if trials else codecs,
                            cluster=cfg.cluster, job=job_args(cfg, env.world))
            report["elapsed_s"] = time.perf_counter() - start
            report["device"] = str(device)
            from thinwire.measure.file import save_profile

            save_profile(prof, out / "profile.yaml")  # with report.json's measurements: advise() can be rerun offline
            tmp = out / f".{REPORT}.tmp"
            tmp.write_text(json.dumps(report, indent=1))
            os.replace(tmp, out / REPORT)
        dist.barrier()
        return report
    finally:
        dist.destroy_process_group()


@record
def main(argv: list[str]) -> int:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING, format=f"thinwire[{rank}]: %(message)s")
    path = Path(argv[0])
    cfg = from_dict(TrainConfig, load_yaml(path), where="")
    try:
        diagnose(cfg, Path(cfg.out))
    except ThinwireError as e:
        print(f"thinwire: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the training worker leaves: gloo's static destructors can abort at exit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
