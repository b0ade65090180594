"""The pipeline model's links against a pipeline whose stages only sleep (issue 23's model rows).

A real stage's compute on a quarter-core host is its own source of error (the host's speed, its CPU quota's
bursts). Here each of 4 emulated hosts runs one stage of ``torch.distributed.pipelining`` (``PipelineStage``,
``Schedule1F1B`` or ``ScheduleGPipe``, gloo) whose forward sleeps ``f`` and whose backward sleeps ``b``
seconds, passing an fp32 tensor of a given size per micro-batch: what is left is the schedule and the links,
which :func:`thinwire.perf.pipeline.simulate_schedule` models. Each configuration's step (median of its
steps after two warm-ups) is compared with

* **the model**: gloo's rendezvous sends and the link's token bucket (the credit ``profile --cluster``'s
  probe measures, :func:`thinwire.measure.network.probe_network`, run on the same cluster first), and
* **eager sends**: each message leaving when its stage has computed it, at the link's rate (the model
  before 2026-12-05, kept here as :func:`eager_step` for the comparison).

Both get the probe's payload rate and one-way latency, and the same per-action overhead (the schedule's
own bookkeeping and the sleeps' overshoot), fitted on the first configuration (64-byte messages, where the
links play no part) and used for every other. Configurations are interleaved, ``--reps`` passes.

    sudo .venv/bin/python benchmarks/pipeline_links.py          # ~5 min
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

# (schedule, micro-batches, bytes per message, forward s, backward s); a list of 4 is per stage
CONFIGS = [
    ("1f1b", 8, 64, 0.004, 0.008),  # the overhead's fit: the links play no part
    ("1f1b", 8, 16384, 0.004, 0.008),
    ("1f1b", 8, 32768, 0.004, 0.008),
    ("1f1b", 8, 65536, 0.004, 0.008),
    ("1f1b", 8, 65536, 0.010, 0.020),
    ("1f1b", 16, 32768, 0.002, 0.004),
    ("1f1b", 16, 131072, 0.004, 0.008),
    ("gpipe", 8, 32768, 0.004, 0.008),
    ("gpipe", 8, 65536, 0.004, 0.008),
    ("1f1b", 16, 32768, [0.001, 0.002, 0.003, 0.0015], [0.002, 0.004, 0.006, 0.003]),
    ("1f1b", 16, 65536, [0.001, 0.002, 0.003, 0.0015], [0.002, 0.004, 0.006, 0.003]),
]
STEPS, WARM = 8, 2


def _stage(cfg: dict) -> None:
    """One rank: a stage that sleeps, ``STEPS`` steps; rank 0 prints each step's seconds."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, f, b):
            ctx.b = b
            time.sleep(f)
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            time.sleep(ctx.b)
            return g * 1.0, None, None

    class Sleeper(nn.Module):
        def __init__(self, f: float, b: float) -> None:
            super().__init__()
            self.f, self.b, self.w = f, b, nn.Parameter(torch.ones(1))

        def forward(self, x):
            return Sleep.apply(x * self.w, self.f, self.b)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pick = lambda v: v[rank] if isinstance(v, list) else v  # noqa: E731
    stage = PipelineStage(Sleeper(pick(cfg["f"]), pick(cfg["b"])), rank, world, torch.device("cpu"))
    kind = Schedule1F1B if cfg["schedule"] == "1f1b" else ScheduleGPipe
    sched = kind(stage, n_microbatches=cfg["M"], loss_fn=lambda out, y: out.sum() * 0.0)
    x = torch.ones(cfg["M"], max(1, cfg["bytes"] // 4))
    times = []
    for _ in range(STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=torch.zeros_like(x))
        else:
            sched.step()
        dist.barrier()  # the step ends with its slowest stage
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps(times), flush=True)
    dist.destroy_process_group()


def eager_step(*, forward_s, backward_s, send_forward_s, send_backward_s, microbatches, schedule, alpha) -> float:
    """Each message leaves when its stage has computed it (first come, first served on the sender's egress, at
    the rate) and arrives ``alpha`` later; stages run their actions in torch's order: the model before
    2026-12-05."""
    from thinwire.perf.pipeline import schedule_actions

    S = len(forward_s)
    actions = [schedule_actions(schedule, s, S, microbatches) for s in range(S)]
    pos, free, egress, arrived = [0] * S, [0.0] * S, [0.0] * S, {}
    moved = True
    while moved:
        moved = False
        for s in range(S):
            while pos[s] < len(actions[s]):
                kind, m = actions[s][pos[s]]
                ready = (arrived.get(("F", s, m)) if s > 0 else 0.0) if kind == "F" else \
                    (arrived.get(("B", s, m)) if s < S - 1 else 0.0)
                if ready is None:
                    break
                end = max(free[s], ready) + (forward_s[s] if kind == "F" else backward_s[s])
                free[s], pos[s], moved = end, pos[s] + 1, True
                if kind == "F" and s < S - 1:
                    egress[s] = max(egress[s], end) + send_forward_s[s]
                    arrived[("F", s + 1, m)] = egress[s] + alpha
                elif kind == "B" and s > 0:
                    egress[s] = max(egress[s], end) + send_backward_s[s]
                    arrived[("B", s - 1, m)] = egress[s] + alpha
    return max(free)


def predict(cfg: dict, net: dict, overhead: float, model: str) -> float:
    from thinwire.perf.pipeline import simulate_schedule

    per = lambda v: [x + overhead for x in (v if isinstance(v, list) else [v] * 4)]  # noqa: E731
    send = [cfg["bytes"] / net["rate_Bps"]] * 4
    args = dict(forward_s=per(cfg["f"]), backward_s=per(cfg["b"]), send_forward_s=send, send_backward_s=send,
                microbatches=cfg["M"], schedule=cfg["schedule"], alpha=net["latency_s"])
    if model == "eager":
        return eager_step(**args)
    return simulate_schedule(**args, credit_s=[net["burst_bytes"] / net["rate_Bps"]] * 4)


def fit_overhead(cfg: dict, net: dict, measured: float) -> float:
    """The per-action overhead at which the model gives ``measured`` for ``cfg`` (bisection)."""
    lo, hi = 0.0, 0.01
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(cfg, net, mid, "model") < measured else (lo, mid)
    return (lo + hi) / 2


def run_config(cluster, cfg: dict) -> list[float]:
    from thinwire.child import pythonpath

    env = {"WORLD_SIZE": "4", "MASTER_ADDR": cluster.host("h0").address,
           "MASTER_PORT": str(random.randint(20000, 60000)), "PYTHONPATH": pythonpath()}
    procs = [cluster.host(f"h{r}").spawn([sys.executable, __file__, "--stage", json.dumps(cfg)],
                                         env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True) for r in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"stage {r} failed (exit {p.returncode}): {err.strip()[-1500:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])[WARM:]


def label(cfg: dict) -> str:
    ms = lambda v: ",".join(f"{x * 1e3:g}" for x in v) if isinstance(v, list) else f"{v * 1e3:g}"  # noqa: E731
    fb = f"f {ms(cfg['f'])} / b {ms(cfg['b'])} ms"
    size = f"{cfg['bytes'] // 1024} KiB" if cfg["bytes"] >= 1024 else f"{cfg['bytes']} B"
    return f"{cfg['schedule']}, M={cfg['M']}, {size}, {fb}"


def markdown(result: dict) -> str:
    net = result["network"]
    L = ["# The pipeline model's links against stages that only sleep\n",
         f"Command: `{result['command']}`  ",
         f"Run {result['started']} UTC at commit {result['commit']}: 4 emulated hosts at {result['rate']}, one "
         f"pipeline stage each (`torch.distributed.pipelining`, gloo) whose forward and backward sleep, an fp32 "
         f"message per micro-batch each way; {result['reps']} passes over the configurations, interleaved; each "
         f"run's median step after {WARM} warm-ups, the median over passes. The network probe on the same cluster: "
         f"{net['rate_Bps'] * 8 / 1e6:.1f} Mbit/s of payload, one-way latency {net['latency_s'] * 1e3:.2f} ms, "
         f"token bucket {net['burst_bytes'] / 1024:.1f} KiB of payload. Per-action overhead fitted on the first "
         f"row: {result['overhead_s'] * 1e3:.2f} ms (both models).\n",
         "**The model** (`simulate_schedule`): gloo's rendezvous sends and the bucket's credit. **Eager sends**: "
         "a message leaves when computed, at the rate (the model before this change).\n",
         "| configuration | measured (ms) | the model (ms) | error | eager sends (ms) | error |",
         "|---|---:|---:|---:|---:|---:|"]
    errs = {"model": [], "eager": []}
    for row in result["rows"]:
        m = row["measured_s"]
        e = {k: row[k] / m - 1 for k in ("model", "eager")}
        fit = " (fit)" if row is result["rows"][0] else ""
        if not fit:
            for k in errs:
                errs[k].append(abs(e[k]))
        L.append(f"| {row['label']}{fit} | {m * 1e3:.1f} | {row['model'] * 1e3:.1f} | {e['model']:+.1%} | "
                 f"{row['eager'] * 1e3:.1f} | {e['eager']:+.1%} |")
    L.append(f"\nMedian absolute error over the rows after the fit: the model {statistics.median(errs['model']):.1%} "
             f"(largest {max(errs['model']):.1%}), eager sends {statistics.median(errs['eager']):.1%} "
             f"(largest {max(errs['eager']):.1%}).")
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="pipeline_links")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.stage is not None:
        _stage(json.loads(a.stage))
        return 0
    if os.geteuid() != 0:
        print("pipeline_links.py needs root for the emulated cluster (network namespaces, tc, cgroups).")
        return 2
    from thinwire.cluster.emulator import EmulatedCluster
    from thinwire.cluster.spec import load_cluster_spec
    from thinwire.measure.network import probe_network

    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    configs = [dict(zip(("schedule", "M", "bytes", "f", "b"), c)) for c in CONFIGS]
    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    with tempfile.TemporaryDirectory(prefix="thinwire-links-") as tmp:
        spec_path = Path(tmp) / "links.yaml"
        spec_path.write_text(f"name: links\nsubnet: 10.244.0.0/24\ndefaults: {{bandwidth: {a.rate}}}\n"
                             "hosts: [{name: h0}, {name: h1}, {name: h2}, {name: h3}]\n")
        spec = load_cluster_spec(spec_path)
        cluster = EmulatedCluster(spec)
        cluster.up()
        try:
            rec = probe_network(spec)
            net = {"rate_Bps": rec.measured_bps / 8, "latency_s": rec.p2p_latency_s, "burst_bytes": rec.burst_bytes}
            print(f"probe: {net}", flush=True)
            for rep in range(a.reps):
                for i, cfg in enumerate(configs):
                    t = statistics.median(run_config(cluster, cfg))
                    times[i].append(t)
                    print(f"pass {rep}: {label(cfg)}: {t * 1e3:.1f} ms", flush=True)
        finally:
            cluster.down()
    measured = [statistics.median(times[i]) for i in range(len(configs))]
    overhead = fit_overhead(configs[0], net, measured[0])
    rows = [{"label": label(cfg), "config": cfg, "measured_s": m, "runs_s": times[i],
             "model": predict(cfg, net, overhead, "model"), "eager": predict(cfg, net, overhead, "eager")}
            for i, (cfg, m) in enumerate(zip(configs, measured))]
    command = "sudo .venv/bin/python benchmarks/pipeline_links.py" + (f" --rate {a.rate}" if a.rate != "100mbit" else "")
    result = {"command": command,
              "started": started, "commit": commit, "rate": a.rate, "reps": a.reps, "network": net,
              "overhead_s": overhead, "rows": rows}
    out = Path(a.out)
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{a.name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
