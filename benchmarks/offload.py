"""The offload engine (issue 24): a host's communication work on a processor of its own, as a smart NIC's.

Two emulated clusters of 4 hosts at 1 Gbit/s, charlm, the same total CPU per host:

* ``engine``: each host 0.3 core of compute and an offload engine of 0.15 core (cluster spec
  ``nic: {cpu: 0.15}``). Contenders: the codec **offloaded** (every bucket's job on thinwire's engine
  thread; that thread and gloo's threads in the engine's cgroup) and the codec **inline**
  (``--set offload=off``: everything on the host's 0.3 core, the engine idle).
* ``no engine``: each host 0.45 core and no engine, the codec inline: the same CPU in one place.

(The issue's setting is 0.5 + 0.25 against 0.75 core; 4 such hosts would need 3 cores and this machine
has 2, so co-located hosts would time-share beyond their quotas. 0.3 + 0.15 against 0.45 keeps the
ratio at 1.8 cores in all.)

Contenders interleaved seed by seed; medians over the seeds. Offloading changes no numerics: the same
seed gives the same validation loss, which the table checks. Writes
``benchmarks/results/offload.{md,json,png}``. Needs root::

    sudo .venv/bin/python benchmarks/offload.py --seeds 0,1,2
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
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from thinwire.cluster.emulator import EmulatedCluster  # noqa: E402
from thinwire.cluster.spec import load_cluster_spec  # noqa: E402

SPECS = {
    "engine": """name: offload-engine
subnet: 10.237.0.0/24
defaults: {bandwidth: 1gbit, cpu: 0.3, nic: {cpu: 0.15}}
hosts: [{name: h0}, {name: h1}, {name: h2}, {name: h3}]
""",
    "no-engine": """name: offload-none
subnet: 10.238.0.0/24
defaults: {bandwidth: 1gbit, cpu: 0.45}
hosts: [{name: h0}, {name: h1}, {name: h2}, {name: h3}]
""",
}
# (label, cluster, --set offload=)
SETUPS = [("0.3 core + engine 0.15, offloaded", "engine", "auto"),
          ("0.3 core + engine 0.15, inline", "engine", "off"),
          ("0.45 core, no engine, inline", "no-engine", "auto")]


def run(spec: Path, codec: str, offload: str, seed: int, out: Path, steps: int) -> dict:
    argv = [sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload", "charlm",
            "--steps", str(steps), "--eval-every", str(steps), "--checkpoint-every", str(steps),
            "--compression", codec, "--seed", str(seed), "--set", f"offload={offload}", "--out", str(out)]
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"step_s": s["median_step_time_s"], "comm_wait_s": s["median_comm_wait_s"], "val_loss": s["val_loss"],
            "codec_s_per_step": s["compression_stats"]["compress_s"] / s["steps"],
            "threads_on_engine": s.get("offload", {}).get("threads_on_engine", 0)}


def markdown(data: dict, command: str) -> str:
    rows = data["rows"]
    lines = [
        "# The offload engine: communication on a processor of its own (issue 24)", "",
        f"Command: `{command}` (root; {data['when']}). 4 emulated hosts at 1 Gbit/s, charlm (default model and "
        f"batch), {data['steps']} steps, seeds {data['seeds']}, contenders interleaved seed by seed; medians over "
        "the seeds. An engine host has 0.3 core of compute and an engine of 0.15 core (spec `nic: {cpu: 0.15}`); "
        "offloaded: every bucket's job on thinwire's engine thread, which with gloo's threads runs in the "
        "engine's cgroup; inline (`--set offload=off`): all of it on the host's 0.3 core. The last setup gives "
        "the same 0.45 core to the host alone. (The issue asks 0.5 + 0.25 against 0.75; four such hosts need "
        "3 cores and this machine has 2.)", "",
        "| codec | setup | step (ms) | comm wait (ms) | codec time per step (ms) | threads on engine | "
        "val loss | step vs inline |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for codec in data["codecs"]:
        inline = rows[codec]["0.3 core + engine 0.15, inline"]["step_s"]
        for label, _, _ in SETUPS:
            r = rows[codec][label]
            lines.append(f"| {codec} | {label} | {r['step_s'] * 1e3:.1f} | {r['comm_wait_s'] * 1e3:.1f} | "
                         f"{r['codec_s_per_step'] * 1e3:.1f} | {r['threads_on_engine']} | {r['val_loss']:.4f} | "
                         f"{inline / r['step_s']:.2f}x |")
    lines += ["", "Per codec, paired seed by seed (median over seeds): how much faster the offloaded step is than "
              "the inline one, and the time it saves per step against the inline codec's own time per step (the "
              "engine also takes gloo's copies and reductions, and its threads no longer wait for the host's "
              "quota, so the saving can exceed the codec's time); whether offloading left the numerics alone "
              "(the same validation loss on every seed).", ""]
    for codec in data["codecs"]:
        off, inl = data["raw"][codec][SETUPS[0][0]], data["raw"][codec][SETUPS[1][0]]
        ratios = [b["step_s"] / a["step_s"] for a, b in zip(off, inl)]
        saved = statistics.median(b["step_s"] - a["step_s"] for a, b in zip(off, inl))
        codec_s = statistics.median(b["codec_s_per_step"] for b in inl)
        lines.append(f"- {codec}: offloaded {statistics.median(ratios):.2f}x faster per step (seeds: "
                     f"{', '.join(f'{r:.2f}x' for r in ratios)}); {saved * 1e3:.1f} ms saved per step against "
                     f"{codec_s * 1e3:.1f} ms of inline codec time; same loss on every seed: {data['same_loss'][codec]}")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(SETUPS)
    for j, (label, _, _) in enumerate(SETUPS):
        xs = [i + j * width for i in range(len(data["codecs"]))]
        ax.bar(xs, [data["rows"][c][label]["step_s"] * 1e3 for c in data["codecs"]], width, label=label)
    ax.set_xticks([i + width for i in range(len(data["codecs"]))], data["codecs"])
    ax.set_ylabel("median step (ms)")
    ax.set_title("4 hosts x 1 Gbit/s, charlm: offload engine vs inline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--codecs", default="int8,bfp")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--name", default="offload")
    ap.add_argument("--rerender", action="store_true", help="rewrite the .md and plot from the .json")
    args = ap.parse_args(argv)
    if args.rerender:
        data = json.loads((RESULTS / f"{args.name}.json").read_text())
        (RESULTS / f"{args.name}.md").write_text(markdown(data, data["command"]))
        plot(data, RESULTS / f"{args.name}.png")
        return
    seeds, codecs = [int(s) for s in args.seeds.split(",")], args.codecs.split(",")
    work = Path(tempfile.mkdtemp(prefix="tw-offload-"))
    specs, clusters = {}, []
    for key, text in SPECS.items():
        specs[key] = work / f"{key}.yaml"
        specs[key].write_text(text)
        c = EmulatedCluster(load_cluster_spec(specs[key]))
        c.up()
        clusters.append(c)
    raw: dict = {c: {label: [] for label, _, _ in SETUPS} for c in codecs}
    try:
        for seed in seeds:
            for codec in codecs:
                for label, key, offload in SETUPS:
                    out = work / f"{codec}-{key}-{offload}-{seed}"
                    r = run(specs[key], codec, offload, seed, out, args.steps)
                    raw[codec][label].append(r)
                    print(f"seed {seed} {codec:5s} {label:36s} step {r['step_s'] * 1e3:6.1f} ms  "
                          f"codec {r['codec_s_per_step'] * 1e3:5.1f} ms  loss {r['val_loss']:.4f}", flush=True)
    finally:
        for c in clusters:
            c.down()
    rows = {c: {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in per.items()}
            for c, per in raw.items()}
    same = {c: all(a["val_loss"] == b["val_loss"] for a, b in zip(raw[c][SETUPS[0][0]], raw[c][SETUPS[1][0]]))
            for c in codecs}
    data = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": args.steps, "seeds": seeds,
            "codecs": codecs, "rows": rows, "raw": raw, "same_loss": same}
    command = " ".join(["sudo .venv/bin/python", "benchmarks/offload.py", *(argv if argv is not None else sys.argv[1:])])
    data["command"] = command
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(data, indent=1))
    (RESULTS / f"{args.name}.md").write_text(markdown(data, command))
    plot(data, RESULTS / f"{args.name}.png")
    print(markdown(data, command))


if __name__ == "__main__":
    main()
