"""Pipelined training on emulated clusters (issue 23): what a pipeline costs and what helps it.

Scenarios (``--scenarios``, each one cluster; contenders interleaved seed by seed, every contender once per
seed before the next seed, medians over seeds):

* ``uneven``: 4 hosts at 1 Gbit/s, 0.5 core each but h2 at 0.25: the planner's split (``plan --pipeline``
  from a profile measured now; the slow host gets fewer layers) against the split balanced by parameters,
  both run as plans (stage s on host h<s>); the table gives each plan's predicted step beside the measured.
* ``does-not-fit``: a charlm whose training state exceeds a 640 MiB host: ``thinwire plan`` on one such host,
  ``thinwire train`` on one (its cgroup kills it), then the planner's pipeline over 4 such hosts, and one
  unlimited process as the reference; validation losses at equal samples side by side.
* ``thin-links``: 4 hosts x 100 Mbit/s, 0.45 core each, charlm cut into 4 stages (1F1B). Contenders: the
  activations and their gradients between stages in fp32, bf16 and int8 (``--pipeline 1f1b:activations=...``),
  and fp32 on unshaped links (the compute floor of the same pipeline). Reports the median step, the final
  validation loss at equal samples and its difference from fp32's (fp32 links compute what one process
  computes, ``tests/test_pipeline.py``: it is the loss control).
* ``bubble``: 4 equal hosts at 1 Gbit/s, a batch of 8: 1F1B against interleaved 1F1B (2 stages per rank),
  each at 4 and at 8 micro-batches; the interleaved schedule's bubble is about half 1F1B's for twice the
  hand-overs. Run it with ``--name pipeline_interleaved`` (its own report).

Each run is ``thinwire train --cluster SPEC --pipeline ...`` as a user would start it; step times are the
medians of each run's ``step_time_s`` after its first 5 steps (shape inference and warm-up), and the
validation loss is the run's own at the last step. After each seed's runs, ``thinwire profile --cluster``
probes each of the scenario's clusters (per-layer costs, host speeds with all hosts computing, latencies)
and the model prices that seed's runs from it: this VM's speed drifts 10-30% within an hour, so a
prediction is compared with the runs measured beside its probe. Writes ``benchmarks/results/pipeline.{json,md,png}``;
``--merge`` keeps the other scenarios' rows; ``--extend`` adds more seeds to a scenario's stored runs, run with
its stored plans (a benchmark split over sessions). Needs root::

    sudo .venv/bin/python benchmarks/pipeline.py --scenarios thin-links --seeds 0,1,2

After a change to the pipeline model, ``--reprice`` prices the stored runs again from the profiles stored
with them (nothing is measured; no root) and rewrites the report; each run keeps its earlier price as
``predicted_step_s_before``. ``tests/test_bench_pipeline.py`` checks the model still gives the committed prices::

    .venv/bin/python benchmarks/pipeline.py --reprice
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

from thinwire.cluster.emulator import EmulatedCluster  # noqa: E402
from thinwire.cluster.spec import load_cluster_spec  # noqa: E402
from thinwire.train.metrics import read_metrics  # noqa: E402

WARM = 5  # steps left out of the median: the schedule's shape inference and the first, slower steps


def spec_text(name: str, hosts: list[dict], rate: str, cpu: float, subnet: str) -> str:
    lines = [f"name: {name}", f"subnet: {subnet}", f"defaults: {{bandwidth: {rate}, cpu: {cpu}}}", "hosts:"]
    lines += ["  - {" + ", ".join(f"{k}: {v}" for k, v in h.items()) + "}" for h in hosts]
    return "\n".join(lines) + "\n"


SCENARIOS = {
    "thin-links": {
        "about": "4 hosts x 100 Mbit/s, 0.45 core each; charlm 2 x 64 wide, context 128, 4 stages, 1F1B, batch 32",
        "hosts": 4, "rate": "100mbit", "cpu": 0.45, "subnet": "10.238.0.0/24", "floor_subnet": "10.239.0.0/24",
        "model": {"layers": 2, "width": 64, "heads": 4, "context": 128}, "batch": 32, "steps": 300, "evals": 6,
        "contenders": {
            "fp32": ["--pipeline", "1f1b:activations=fp32"],
            "bf16": ["--pipeline", "1f1b:activations=bf16"],
            "int8": ["--pipeline", "1f1b:activations=int8"],
            "fp32, unshaped links (floor)": ["--pipeline", "1f1b:activations=fp32"],
        },
        "unshaped": ["fp32, unshaped links (floor)"],
        "control": "fp32",
    },
    "uneven": {
        "about": "4 hosts x 1 Gbit/s at 0.5 core, host h2 at 0.25 core; charlm 6 x 128 wide, context 64, 4 stages, "
                 "1F1B, batch 32; both contenders are plans (stage s on host h<s>)",
        "hosts": 4, "rate": "1gbit", "cpu": 0.5, "host_cpu": {"h2": 0.25}, "subnet": "10.240.0.0/24",
        "model": {"layers": 6, "width": 128, "heads": 4, "context": 64}, "batch": 32, "steps": 150, "evals": 3,
        "plans": True,
        "contenders": {
            "planner's split (by host speed)": ["--plan", "{plan}"],
            "even split (by parameters)": ["--plan", "{even}"],
        },
        "control": "even split (by parameters)",
    },
    "bubble": {
        "about": "4 hosts x 1 Gbit/s, 0.5 core each; charlm 8 x 128 wide, context 64, 4 ranks, batch 8 (a batch too "
                 "small for the bubble to vanish: 1F1B idles (S-1)/(M+S-1) of the step)",
        "hosts": 4, "rate": "1gbit", "cpu": 0.5, "subnet": "10.244.0.0/24", "probe_micro": 2,
        "model": {"layers": 8, "width": 128, "heads": 4, "context": 64}, "batch": 8, "steps": 100, "evals": 2,
        "contenders": {
            "1f1b, 4 micro-batches": ["--pipeline", "1f1b:microbatches=4"],
            "interleaved, 2 stages per rank, 4 micro-batches": ["--pipeline", "interleaved:microbatches=4"],
            "1f1b, 8 micro-batches (its default)": ["--pipeline", "1f1b"],
            "interleaved, 2 stages per rank, 8 micro-batches": ["--pipeline", "interleaved"],
        },
        "control": "1f1b, 4 micro-batches",
    },
}


def scenario_hosts(sc: dict) -> list[dict]:
    """The scenario's hosts for its cluster spec: h0, h1, ..., each with its own CPU quota where it has one."""
    return [{"name": f"h{i}", **({"cpu": sc["host_cpu"][f"h{i}"]} if f"h{i}" in sc.get("host_cpu", {}) else {})}
            for i in range(sc["hosts"])]


def fit4_spec_text() -> str:
    """does-not-fit's cluster: 4 hosts at FIT's memory limit, rate and quota."""
    return spec_text("pipe-fit4", [{"name": f"h{i}", "memory": FIT["memory"]} for i in range(4)], FIT["rate"],
                     FIT["cpu"], FIT["subnet"])


def train_argv(sc: dict, args: list[str], out: Path, seed: int, spec: Path, files: dict | None = None) -> list[str]:
    steps = sc["steps"]
    args = [a.format(**(files or {})) for a in args]
    return [sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload", "charlm",
            "--steps", str(steps), "--batch-size", str(sc["batch"]), "--threads", "1", "--seed", str(seed),
            "--eval-every", str(max(1, steps // sc["evals"])), "--checkpoint-every", str(steps),
            "--set", "warmup_steps=10", "--out", str(out), *args,
            *(a for k, v in sc["model"].items() for a in ("--set", f"model.{k}={v}"))]


def run_one(sc: dict, name: str, out: Path, seed: int, spec: Path, files: dict | None = None) -> dict:
    t0 = time.time()
    proc = subprocess.run(train_argv(sc, sc["contenders"][name], out, seed, spec, files), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    recs = read_metrics(out)
    steps = [r for r in recs if "step_time_s" in r]
    summary = json.loads((out / "summary.json").read_text())
    return {"seed": seed, "elapsed_s": time.time() - t0,
            "median_step_s": statistics.median(r["step_time_s"] for r in steps[WARM:]),
            "median_activation_bytes": statistics.median(r.get("activation_bytes", 0) for r in steps[WARM:]),
            "val": [[r["step"], r["val_loss"]] for r in recs if "val_loss" in r],
            "final_val_loss": summary.get("val_loss"), "pipeline": summary.get("pipeline"),
            "planned_step_s": (summary.get("pipeline") or {}).get("predicted_step_s"),
            "loss": [[r["step"], r["loss"]] for r in steps]}


def bench(key: str, seeds: list[int], work: Path, plans: dict | None = None) -> dict:
    sc = SCENARIOS[key]
    hosts = scenario_hosts(sc)
    shaped = work / f"{key}.yaml"
    shaped.write_text(spec_text(f"pipe-{key}", hosts, sc["rate"], sc["cpu"], sc["subnet"]))
    specs = [shaped]
    if sc.get("unshaped"):
        floor = work / f"{key}-floor.yaml"
        floor.write_text(spec_text(f"pipe-{key}-floor", hosts, "100gbit", sc["cpu"], sc["floor_subnet"]))
        specs.append(floor)
    files = {}
    if sc.get("plans") and plans:  # --extend: the stored runs' plans, so that the new seeds run what they ran
        (work / key).mkdir(parents=True, exist_ok=True)
        for k, text in plans.items():
            (work / key / f"{k}.yaml").write_text(text)
            files[k] = str(work / key / f"{k}.yaml")
    elif sc.get("plans"):
        files = make_plans(sc, shaped, work / key)
    runs: dict[str, list[dict]] = {name: [] for name in sc["contenders"]}
    profiles: dict[str, str] = {}
    clusters = {s: EmulatedCluster(load_cluster_spec(s)) for s in specs}
    for c in clusters.values():
        c.up()
    try:
        for seed in seeds:  # seed-major: every contender once per seed, so a slow spell hits them all
            for k, name in enumerate(sc["contenders"]):
                spec = floor if name in sc.get("unshaped", []) else shaped
                out = work / f"{key}-c{k}-s{seed}"
                print(f"[{key}] {name}, seed {seed} ...", flush=True)
                r = run_one(sc, name, out, seed, spec, files)
                runs[name].append(r)
                print(f"    {r['median_step_s'] * 1e3:.0f} ms/step, val {r['final_val_loss']:.4f}" if "error" not in r
                      else f"    FAILED: {r['error'][-600:]}", flush=True)
            for spec in specs:  # the model's inputs measured now, next to this seed's runs (the VM drifts)
                rate = "100gbit" if spec != shaped else sc["rate"]
                prof = probe(sc, spec, work / f"{key}-{rate}-s{seed}-profile.yaml")
                profiles[f"{rate}, seed {seed}"] = prof.read_text()
                for name in sc["contenders"]:
                    if (name in sc.get("unshaped", [])) == (spec != shaped) and "error" not in runs[name][-1]:
                        step, why, stage_s = predict_step(sc, sc["contenders"][name], load_cluster_spec(spec), prof,
                                                          files)
                        runs[name][-1]["predicted_step_s"], runs[name][-1]["predicted_stage_s"] = step, stage_s
                        print(f"    {name}: predicted {step * 1e3:.0f} ms ({why})", flush=True)
    finally:
        for c in clusters.values():
            c.down()
    return {"scenario": key, "about": sc["about"], "seeds": seeds, "control": sc["control"], "runs": runs,
            "steps": sc["steps"], "batch": sc["batch"], "model": sc["model"], "profiles": profiles,
            "plans": {k: Path(v).read_text() for k, v in files.items() if k in ("plan", "even")}}


def extended(stored: dict, new: dict) -> dict:
    """A scenario's stored runs with ``new``'s seeds added (``--extend``): every contender's runs, the seeds and the
    profiles measured beside them.

    >>> a = {"seeds": [0], "runs": {"x": [{"seed": 0}]}, "profiles": {"1gbit, seed 0": "p0"}, "plans": {"plan": "P"}}
    >>> b = {"seeds": [3], "runs": {"x": [{"seed": 3}]}, "profiles": {"1gbit, seed 3": "p3"}, "plans": {"plan": "P"}}
    >>> e = extended(a, b)
    >>> e["seeds"], [r["seed"] for r in e["runs"]["x"]], sorted(e["profiles"])
    ([0, 3], [0, 3], ['1gbit, seed 0', '1gbit, seed 3'])
    """
    out = dict(stored)
    out["seeds"] = [*stored["seeds"], *new["seeds"]]
    out["runs"] = {name: [*stored["runs"].get(name, []), *new["runs"][name]] for name in new["runs"]}
    out["profiles"] = {**stored.get("profiles", {}), **new.get("profiles", {})}
    return out


def make_plans(sc: dict, spec: Path, folder: Path) -> dict:
    """The planner's pipeline plan from a profile measured now at the micro-batch size, and the same plan
    with the split balanced by parameters (what ``--pipeline`` does without ``layers=``), stage s on host
    h<s> in both."""
    import dataclasses

    from thinwire.measure.file import load_profile
    from thinwire.pipeline.layout import default_microbatches
    from thinwire.pipeline.stages import balanced_split
    from thinwire.plan.planfile import read_plan, save_plan

    folder.mkdir(parents=True, exist_ok=True)
    micro = sc.get("probe_micro") or sc["batch"] // default_microbatches(sc["batch"], sc["hosts"])
    model = [a for k, v in sc["model"].items() for a in ("--set", f"model.{k}={v}")]
    prof, plan, even = folder / "profile.yaml", folder / "plan.yaml", folder / "even.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv in ([sys.executable, "-m", "thinwire", "profile", "--workload", "charlm", *model, "--batch-sizes",
                  str(micro), "--codecs", "none", "--guard-steps", "0", "--out", str(prof)],
                 [sys.executable, "-m", "thinwire", "plan", "--cluster", str(spec), "--workload", "charlm", *model,
                  "--profile", str(prof), "--batch-size", str(sc["batch"]), "--pipeline", "--colocated",
                  str(os.cpu_count() or 2), "--threads", "1", "--out", str(plan)]):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{argv[3]} failed: {proc.stderr[-2000:]}")
        print(proc.stdout[-3000:], flush=True)
    p = read_plan(plan)
    layers = load_profile(prof).layers
    runs = balanced_split([float(l.parameters) for l in layers], len(p.pipeline.stages))
    stages = [dataclasses.replace(st, first_layer=r[0], last_layer=r[-1], layers=[layers[i].name for i in r],
                                  parameters=sum(layers[i].parameters for i in r))
              for st, r in zip(p.pipeline.stages, runs)]
    save_plan(dataclasses.replace(p, pipeline=dataclasses.replace(p.pipeline, stages=stages,
                                                                  predicted_step_s=p.pipeline.even_split_step_s)), even)
    return {"plan": str(plan), "even": str(even), "profile": str(prof)}


FIT = {  # does not fit, then trains
    "about": "charlm 8 x 512 wide, context 64 (25.3M parameters), batch 8, hosts of 640 MiB (cgroup memory limit), "
             "0.45 core, 1 Gbit/s",
    "model": {"layers": 8, "width": 512, "heads": 8, "context": 64}, "batch": 8, "steps": 40, "evals": 4,
    "memory": "640MiB", "cpu": 0.45, "rate": "1gbit", "subnet": "10.241.0.0/24", "one_subnet": "10.242.0.0/24",
    "probe_subnet": "10.243.0.0/24", "hosts": 4,
}


def bench_fit(seeds: list[int], work: Path) -> dict:
    """A model whose training state exceeds one host's memory: the planner refuses one host, one host's run
    is killed by its cgroup, the planner's pipeline over 4 such hosts trains, and its validation losses
    match one unlimited process's at equal samples (fp32 links: the same computation)."""
    sc = {**FIT, "contenders": {}}
    model = [a for k, v in FIT["model"].items() for a in ("--set", f"model.{k}={v}")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    four, one = work / "fit4.yaml", work / "fit1.yaml"
    four.write_text(fit4_spec_text())
    one.write_text(spec_text("pipe-fit1", [{"name": "h0", "memory": FIT["memory"]}], FIT["rate"], FIT["cpu"],
                             FIT["one_subnet"]))
    prof, plan4 = work / "fit-profile.yaml", work / "fit-plan4.yaml"
    result: dict = {"scenario": "does-not-fit", "about": FIT["about"], "seeds": seeds, "steps": FIT["steps"]}
    subprocess.run([sys.executable, "-m", "thinwire", "profile", "--workload", "charlm", *model, "--batch-sizes", "1",
                    "--codecs", "none", "--guard-steps", "0", "--no-corun", "--out", str(prof)], check=True, env=env,
                   capture_output=True, text=True)
    plan1 = subprocess.run([sys.executable, "-m", "thinwire", "plan", "--cluster", str(one), "--workload", "charlm",
                            *model, "--profile", str(prof), "--batch-size", str(FIT["batch"]), "--out",
                            str(work / "fit-plan1.yaml")], env=env, capture_output=True, text=True)
    result["one_host_plan"] = {"exit": plan1.returncode, "stderr": plan1.stderr.strip()[-1500:]}
    p4 = subprocess.run([sys.executable, "-m", "thinwire", "plan", "--cluster", str(four), "--workload", "charlm",
                         *model, "--profile", str(prof), "--batch-size", str(FIT["batch"]), "--colocated",
                         str(os.cpu_count() or 2), "--threads", "1", "--out", str(plan4)], env=env, capture_output=True,
                        text=True)
    if p4.returncode != 0:
        raise SystemExit(f"plan on 4 hosts failed: {p4.stderr[-2000:]}")
    result["plan"] = plan4.read_text()
    result["plan_stdout"] = p4.stdout[-4000:]
    # the model's inputs come from `profile --cluster` on the same four hosts without their memory limit: its
    # host-speed probe runs the whole model's step on every host, which is what does not fit them
    probe_spec = work / "fit4-probe.yaml"
    probe_spec.write_text(spec_text("pipe-fit4p", [{"name": f"h{i}"} for i in range(4)], FIT["rate"], FIT["cpu"],
                                    FIT["probe_subnet"]))
    result["profiles"] = {}
    clusters = [EmulatedCluster(load_cluster_spec(s)) for s in (four, one, probe_spec)]
    for c in clusters:
        c.up()
    try:
        out = work / "fit-one-host"
        t0 = time.time()
        proc = subprocess.run(train_argv({**sc, "steps": 3}, [], out, seeds[0], one), capture_output=True, text=True,
                              env=env, timeout=1800)
        result["one_host_train"] = {"exit": proc.returncode, "elapsed_s": time.time() - t0,
                                    "stderr": (proc.stderr or proc.stdout).strip()[-1500:]}
        print(f"[does-not-fit] one host: exit {proc.returncode}", flush=True)
        result["runs"] = {"pipeline, 4 hosts (plan)": [], "reference, 1 process, no limit": []}
        for seed in seeds:
            print(f"[does-not-fit] pipeline, seed {seed} ...", flush=True)
            r = run_one({**sc, "contenders": {"p": ["--plan", str(plan4)]}}, "p", work / f"fit-pipe-s{seed}", seed, four)
            result["runs"]["pipeline, 4 hosts (plan)"].append(r)
            print(f"    {r.get('median_step_s', float('nan')) * 1e3:.0f} ms/step, val {r.get('final_val_loss')}", flush=True)
            prof = probe(FIT, probe_spec, work / f"fit-s{seed}-profile.yaml")
            result["profiles"][f"1gbit without the memory limit, seed {seed}"] = prof.read_text()
            if "error" not in r:
                r["predicted_step_s"], why, r["predicted_stage_s"] = predict_step(
                    FIT, ["--plan", "{plan}"], load_cluster_spec(four), prof, {"plan": str(plan4)})
                print(f"    predicted {r['predicted_step_s'] * 1e3:.0f} ms ({why})", flush=True)
            ref = work / f"fit-ref-s{seed}"
            argv = [a for a in train_argv(sc, [], ref, seed, one) if a not in ("--cluster", str(one))]
            subprocess.run(argv + ["--nproc", "1"], check=True, env=env, capture_output=True, text=True, timeout=3600)
            recs = read_metrics(ref)
            result["runs"]["reference, 1 process, no limit"].append(
                {"seed": seed, "val": [[x["step"], x["val_loss"]] for x in recs if "val_loss" in x],
                 "final_val_loss": json.loads((ref / "summary.json").read_text())["val_loss"],
                 "peak_rss_note": "unlimited"})
    finally:
        for c in clusters:
            c.down()
    return result


def fit_markdown(r: dict) -> list[str]:
    pipe, ref = r["runs"]["pipeline, 4 hosts (plan)"], r["runs"]["reference, 1 process, no limit"]
    out = ["## does-not-fit", "", r["about"] + f"; {r['steps']} steps, seeds {r['seeds']}.", "",
           f"- `thinwire plan` on one such host: exit {r['one_host_plan']['exit']}: "
           f"{r['one_host_plan']['stderr'].splitlines()[-1] if r['one_host_plan']['stderr'] else ''}",
           f"- `thinwire train` on one such host: exit {r['one_host_train']['exit']} after "
           f"{r['one_host_train']['elapsed_s']:.0f} s: {(r['one_host_train']['stderr'].splitlines() or [''])[-1][:400]}",
           "", *probe_lines(r),
           "| seed | pipeline median step (ms) | predicted (ms) | pipeline val losses | reference val losses | "
           "largest difference |", "|---:|---:|---:|---|---|---:|"]
    for p, q in zip(pipe, ref):
        if "error" in p:
            out.append(f"| {p.get('seed', '?')} | failed: {p['error'][-200:]} | | | | |")
            continue
        a, b = [v for _, v in p["val"]], [v for _, v in q["val"]]
        diff = max(abs(x / y - 1) for x, y in zip(a, b))
        pred = p.get("predicted_step_s")
        pred = f"{pred * 1e3:.0f} ({(pred / p['median_step_s'] - 1) * 100:+.0f}%)" if pred else "-"
        out.append(f"| {p['seed']} | {p['median_step_s'] * 1e3:.0f} | {pred} | {', '.join(f'{x:.4f}' for x in a)} | "
                   f"{', '.join(f'{x:.4f}' for x in b)} | {diff * 100:.3f}% |")
    step, pred = med(pipe, "median_step_s"), med(pipe, "predicted_step_s")
    if step and pred:
        out.append(f"| median | {step * 1e3:.0f} | {pred * 1e3:.0f} ({(pred / step - 1) * 100:+.0f}%) | | | |")
    return out + [""] + clock_lines({k: v for k, v in r["runs"].items() if k != "reference, 1 process, no limit"})


def probe(sc: dict, spec: Path, out: Path) -> Path:
    """``thinwire profile --cluster SPEC`` on the (running) cluster, as a user would price a pipeline there: the
    model's per-layer costs at the micro-batch size, the hosts' speeds with all of them computing at once, the
    network's latencies."""
    from thinwire.pipeline.layout import default_microbatches

    micro = sc.get("probe_micro") or sc["batch"] // default_microbatches(sc["batch"], sc["hosts"])
    model = [a for k, v in sc["model"].items() for a in ("--set", f"model.{k}={v}")]
    subprocess.run([sys.executable, "-m", "thinwire", "profile", "--workload", "charlm", *model, "--batch-sizes",
                    str(micro), "--codecs", "none", "--guard-steps", "0", "--cluster", str(spec), "--out", str(out)],
                   check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    return out


def predict_step(sc: dict, args: list[str], spec, profile_path: Path, plans: dict) -> tuple[float, str, list[float]]:
    """The model's step for a contender run with ``args`` (a pipeline spec, or a plan) from a probe's profile,
    why, and its compute per micro-batch of each stage (forward and backward).
    ``plans`` maps ``plan``/``even`` to a plan file or to its text."""
    from thinwire.measure.file import load_profile
    from thinwire.pipeline.layout import layout
    from thinwire.pipespec import parse_pipeline_spec
    from thinwire.plan.planfile import read_plan
    from thinwire.sim.pipeline import predict_pipeline

    profile = load_profile(profile_path)
    if "--plan" in args:
        which = args[args.index("--plan") + 1].strip("{}")
        source = plans[which]
        if not Path(source).is_file():
            path = profile_path.with_name(f"{profile_path.stem}-stored-{which}.yaml")
            path.write_text(source)
            source = path
        pipe = parse_pipeline_spec(read_plan(Path(source)).pipeline.spec_text())
    else:
        pipe = parse_pipeline_spec(args[args.index("--pipeline") + 1])
    lay = layout(pipe, [l.name for l in profile.layers], [l.parameters for l in profile.layers], sc["hosts"],
                 sc["batch"])
    pred = predict_pipeline(spec, profile, list(spec.hosts), lay.runs, microbatches=lay.microbatches,
                            replica_batch=lay.replica_batch, activations=lay.links, threads=1,
                            colocated_cores=float(os.cpu_count() or 2), recompute=pipe.recompute,
                            schedule=pipe.schedule)
    return pred.step_s, pred.bottleneck, pred.stage_s


def add_predictions(result: dict, key: str, work: Path) -> None:
    """Re-price stored runs from probes measured now (``--predict-only``): every run of a contender gets the
    same prediction; a fresh run predicts each seed from a probe taken right after that seed's runs."""
    from thinwire.cluster.spec import load_cluster_spec as load

    sc = SCENARIOS[key]
    hosts = scenario_hosts(sc)
    result["profiles"] = {}
    for rate in dict.fromkeys("100gbit" if n in sc.get("unshaped", []) else sc["rate"] for n in sc["contenders"]):
        path = work / f"{key}-{rate}-predict.yaml"
        path.write_text(spec_text(f"pp-{rate}", hosts, rate, sc["cpu"],
                                  sc["floor_subnet"] if rate == "100gbit" and "floor_subnet" in sc else sc["subnet"]))
        cluster = EmulatedCluster(load(path))
        cluster.up()
        try:
            prof = probe(sc, path, work / f"{key}-{rate}-profile.yaml")
        finally:
            cluster.down()
        result["profiles"][f"{rate}, re-probed"] = prof.read_text()
        for name in sc["contenders"]:
            if ("100gbit" if name in sc.get("unshaped", []) else sc["rate"]) != rate:
                continue
            step, why, stage_s = predict_step(sc, sc["contenders"][name], load(path), prof, result["plans"])
            for run in result["runs"][name]:
                run["predicted_step_s"], run["predicted_stage_s"] = step, stage_s
            print(f"[{key}] {name}: predicted {step * 1e3:.0f} ms ({why})", flush=True)


def reprice(result: dict, key: str, work: Path) -> None:
    """Price the stored runs again from the profiles stored with them (``--reprice``: the model changed, the
    measurements did not; nothing runs). Each run's earlier prediction stays as ``predicted_step_s_before``."""
    from thinwire.cluster.spec import load_cluster_spec as load

    for label, text in (result.get("profiles") or {}).items():
        seed = int(label.rsplit("seed ", 1)[1])
        prof = work / f"{key}-s{seed}-{label.split(',')[0].replace(' ', '_')}-stored.yaml"
        prof.write_text(text)
        if key == "does-not-fit":
            four = work / "fit4.yaml"
            four.write_text(fit4_spec_text())
            plan = work / "fit-plan.yaml"
            plan.write_text(result["plan"])
            todo = [("pipeline, 4 hosts (plan)", FIT, ["--plan", "{plan}"], load(four), {"plan": str(plan)})]
        else:
            sc = SCENARIOS[key]
            rate = label.split(",")[0]
            hosts = scenario_hosts(sc)
            spec = work / f"{key}-{rate}.yaml"  # named as bench() named it: the profile's host speeds are the cluster's
            floor = rate == "100gbit" and "floor_subnet" in sc
            spec.write_text(spec_text(f"pipe-{key}-floor" if floor else f"pipe-{key}", hosts, rate, sc["cpu"],
                                      sc["floor_subnet"] if floor else sc["subnet"]))
            todo = [(name, sc, args, load(spec), result.get("plans", {})) for name, args in sc["contenders"].items()
                    if ("100gbit" if name in sc.get("unshaped", []) else sc["rate"]) == rate]
        for name, sc, args, spec, plans in todo:
            run = result["runs"][name][result["seeds"].index(seed)]
            if "error" in run or run.get("predicted_step_s") is None:
                continue
            step, why, stage_s = predict_step(sc, args, spec, prof, plans)
            run["predicted_step_s_before"] = run["predicted_step_s"]
            run["predicted_step_s"], run["predicted_stage_s"] = step, stage_s
            print(f"[{key}] {name}, seed {seed}: predicted {run['predicted_step_s_before'] * 1e3:.0f} -> {step * 1e3:.0f} ms, "
                  f"measured {run['median_step_s'] * 1e3:.0f} ({why})", flush=True)


def probe_lines(r: dict) -> list[str]:
    """What ``thinwire profile --cluster`` found on each of the scenario's clusters (the model's inputs)."""
    import yaml

    out = []
    for label, text in (r.get("profiles") or {}).items():
        prof = yaml.safe_load(text)
        net, hs = prof.get("network") or {}, (prof.get("host_speed") or {}).get("speed", {})
        bucket = "" if net.get("burst_bytes") is None else f"links' token bucket {net['burst_bytes'] / 1024:.1f} KiB, "
        out.append(f"- `thinwire profile --cluster` ({label}): "
                   f"hand-off latency {net.get('p2p_latency_s', 0) * 1e3:.2f} ms, collective latency per hop "
                   f"{net.get('alpha_s', 0) * 1e3:.2f} ms, {bucket}host speeds (one process alone here = 1) "
                   + ", ".join(f"{h} {v:.2f}" for h, v in hs.items()) + ".")
    return out + ([""] if out else [])


def clock_lines(runs: dict) -> list[str]:
    """Where each contender's step went: every stage's compute per micro-batch as the run timed it (torch's
    forward and backward chunks, ``summary.json``'s ``pipeline.stage_compute``) and its busy share of the
    schedule, against the model's compute per micro-batch for that stage; medians over seeds. Runs that
    predate the stage clock have none."""
    rows = []
    for name, rs in runs.items():
        ok = [x for x in rs if "error" not in x and (x.get("pipeline") or {}).get("stage_compute")]
        if not ok:
            continue
        S = len(ok[0]["pipeline"]["stage_compute"])
        cells = []
        for k in range(S):
            comp = statistics.median((c := x["pipeline"]["stage_compute"][k])["forward_s_per_microbatch"]
                                     + c["backward_s_per_microbatch"] for x in ok)
            busy = statistics.median(x["pipeline"]["stage_compute"][k]["busy"] for x in ok)
            model = [x["predicted_stage_s"][k] for x in ok if len(x.get("predicted_stage_s") or []) == S]
            cells.append(f"{comp * 1e3:.1f} ({busy:.0%})"
                         + (f" / {statistics.median(model) * 1e3:.1f}" if model else ""))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    S = max(r.count("|") - 2 for r in rows)
    return ["Where the step went: each stage's compute per micro-batch in ms as the run timed it (its busy share "
            "of the schedule) / the model's, medians over seeds.", "",
            "| contender | " + " | ".join(f"stage {k}" for k in range(S)) + " |", "|---|" + "---:|" * S, *rows, ""]


def med(runs: list[dict], field: str) -> float | None:
    xs = [r[field] for r in runs if "error" not in r and r.get(field) is not None]
    return statistics.median(xs) if xs else None


def markdown(results: dict) -> str:
    out = ["# Pipelined training on emulated clusters", "",
           "Produced by `sudo .venv/bin/python benchmarks/pipeline.py --scenarios SCENARIO --seeds 0,1,2 --merge` "
           f"({time.strftime('%Y-%m-%d')}, this 2-core VM; each host an emulated machine with its own network "
           "namespace, tc-shaped link and cgroup CPU quota). Contenders interleaved seed by seed; medians over seeds. "
           f"Step times: median of each run's steps after the first {WARM}.", ""]
    for key, r in results.items():
        if key == "does-not-fit":
            out += fit_markdown(r)
            continue
        ctl = r["runs"][r["control"]]
        ctl_step, ctl_loss = med(ctl, "median_step_s"), med(ctl, "final_val_loss")
        out += [f"## {key}", "", r["about"] + f"; {r['steps']} steps, seeds {r['seeds']}.", ""]
        out += probe_lines(r)
        out += ["| contender | median step (ms) | speed-up vs " + r["control"] + " | predicted step (ms), median of seeds | bytes sent per "
                "step, rank 0 (MB) | final val loss (median) | vs " + r["control"] + " |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, runs in r["runs"].items():
            step, loss = med(runs, "median_step_s"), med(runs, "final_val_loss")
            if step is None:
                out.append(f"| {name} | failed | | | | | |")
                continue
            pred = med(runs, "predicted_step_s")
            seeds = ", ".join(f"{(x['predicted_step_s'] / x['median_step_s'] - 1) * 100:+.0f}" for x in runs
                              if "error" not in x and x.get("predicted_step_s"))
            pred = f"{pred * 1e3:.0f} ({(pred / step - 1) * 100:+.0f}%; by seed {seeds}%)" if pred else "-"
            out.append(f"| {name} | {step * 1e3:.0f} | {ctl_step / step:.2f}x | {pred} | "
                       f"{med(runs, 'median_activation_bytes') / 1e6:.2f} | {loss:.4f} | {(loss / ctl_loss - 1) * 100:+.2f}% |")
        out.append("")
        out += clock_lines(r["runs"])
    return "\n".join(out)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (key, r) in zip(axes[0], results.items()):
        if key == "does-not-fit":
            for name, runs in r["runs"].items():
                ok = [x for x in runs if "error" not in x]
                if ok:
                    ax.plot([s for s, _ in ok[0]["val"]], [v for _, v in ok[0]["val"]], marker="o", ms=3, label=name)
            ax.set_xlabel("step (equal samples), seed " + str(r["seeds"][0]))
            ax.set_ylabel("validation loss")
            ax.set_title(key)
            ax.legend(fontsize=8)
            continue
        for name, runs in r["runs"].items():
            ok = [x for x in runs if "error" not in x]
            if not ok:
                continue
            seed0 = ok[0]
            t = [s * seed0["median_step_s"] for s, _ in seed0["val"]]
            ax.plot(t, [v for _, v in seed0["val"]], marker="o", ms=3, label=f"{name} ({seed0['median_step_s'] * 1e3:.0f} ms/step)")
        ax.set_xlabel("seconds (steps x median step), seed " + str(r["seeds"][0]))
        ax.set_ylabel("validation loss")
        ax.set_title(key)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join([*SCENARIOS, "does-not-fit"]))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--merge", action="store_true", help="keep the other scenarios of results/pipeline.json")
    ap.add_argument("--predict-only", action="store_true", help="add the model's predictions to the scenarios' stored "
                    "runs (a profile measured now; a run measures and predicts anyway) and rewrite the report")
    ap.add_argument("--reprice", action="store_true", help="price the stored runs again from their stored profiles "
                    "(the model changed; nothing is measured, no root needed) and rewrite the report")
    ap.add_argument("--extend", action="store_true", help="run --seeds (seeds not yet stored) of the scenarios and "
                    "add them to the stored runs, with the stored plans: a benchmark split over sessions")
    ap.add_argument("--name", default="pipeline")
    a = ap.parse_args()
    if a.reprice:
        path = RESULTS / f"{a.name}.json"
        if not path.exists():
            raise SystemExit(f"--reprice: no stored runs at {path}; run the benchmark first, or give --name NAME of "
                             "a results/NAME.json it wrote")
        results = json.loads(path.read_text())
        work = Path(tempfile.mkdtemp(prefix="thinwire-pipeline-"))
        for key in [k.strip() for k in a.scenarios.split(",") if k.strip() in results]:
            reprice(results[key], key, work)
        path.write_text(json.dumps(results, indent=1))
        (RESULTS / f"{a.name}.md").write_text(markdown(results))
        return 0
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/pipeline.py needs root (network namespaces, tc, cgroups)")
    keys = [k.strip() for k in a.scenarios.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SCENARIOS and k != "does-not-fit"]
    if unknown:
        raise SystemExit(f"--scenarios: unknown {unknown}; known: {', '.join(SCENARIOS)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    path = RESULTS / f"{a.name}.json"
    results = json.loads(path.read_text()) if (a.merge or a.predict_only or a.extend) and path.exists() else {}
    if a.extend:
        for key in keys:
            if key == "does-not-fit" or key not in results:
                raise SystemExit(f"--extend: {key} " + ("is not extended (run it again with --merge)"
                                                        if key == "does-not-fit" else f"has no stored runs in {path}"))
            again = sorted(set(seeds) & set(results[key]["seeds"]))
            if again:
                raise SystemExit(f"--extend: {key} already holds seeds {again}; give other seeds")
    work = Path(tempfile.mkdtemp(prefix="thinwire-pipeline-"))
    if a.predict_only:
        for key in keys:
            add_predictions(results[key], key, work)
        path.write_text(json.dumps(results, indent=1))
        (RESULTS / f"{a.name}.md").write_text(markdown(results))
        print((RESULTS / f"{a.name}.md").read_text())
        return 0
    for key in keys:
        if a.extend:
            results[key] = extended(results[key], bench(key, seeds, work, plans=results[key].get("plans")))
        else:
            results[key] = bench_fit(seeds, work) if key == "does-not-fit" else bench(key, seeds, work)
        path.write_text(json.dumps(results, indent=1))  # each scenario's rows as soon as they exist
        (RESULTS / f"{a.name}.md").write_text(markdown(results))
    plot(results, RESULTS / f"{a.name}.png")
    print((RESULTS / f"{a.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
