"""A host leaves and comes back during a run (issue 22): the world size changes, the loss curve goes on.

On an emulated cluster of 4 hosts (100 Mbit/s, 0.45 core each), ``thinwire train --min-hosts 3``
trains charlm; when the run reaches ``--kill-at`` steps, ``thinwire cluster kill`` takes host h3
away (link down, its processes SIGKILLed, as a machine that dies); the other three notice within
the collective timeout, meet again without it and go on from the last checkpoint. ``--back-after``
steps later h3 is restored and joins at the next rendezvous. A control run on the same cluster
trains the same steps with no host lost. Both send fp32 gradients (``--compression none``): with
the same global batch in the same order, the averaged gradient is the same at any world size, so
the two loss curves should agree up to floating-point summation order.

Writes ``benchmarks/results/elastic.{md,json,png}``. Needs root::

    sudo .venv/bin/python benchmarks/elastic.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SPEC = """name: elastic-demo
subnet: 10.236.0.0/24
defaults: {bandwidth: 100mbit, cpu: 0.45}
hosts: [{name: h0}, {name: h1}, {name: h2}, {name: h3}]
"""


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def max_step(out: Path) -> int:
    return max((r.get("step", 0) for r in records(out) if "loss" in r), default=0)


def train(spec: Path, out: Path, args) -> subprocess.Popen:
    argv = [sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload", "charlm",
            "--steps", str(args.steps), "--batch-size", "24", "--checkpoint-every", str(args.checkpoint_every),
            "--eval-every", str(args.eval_every), "--compression", "none", "--min-hosts", "3",
            "--max-restarts", "3", "--set", f"timeout_s={args.timeout}", "--out", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait(pred, proc: subprocess.Popen, what: str, limit: float = 600) -> None:
    deadline = time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        if pred():
            return
        time.sleep(0.1)
    raise SystemExit(f"{what}: not reached (exit {proc.poll()}): {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}")


def run(args) -> dict:
    from thinwire.cluster.emulator import EmulatedCluster
    from thinwire.cluster.spec import load_cluster_spec

    work = Path(tempfile.mkdtemp(prefix="thinwire-elastic-"))
    spec = work / "spec.yaml"
    spec.write_text(SPEC)
    cluster = EmulatedCluster(load_cluster_spec(spec))
    built = cluster.up()
    try:
        out = work / "elastic"
        t0 = time.time()
        proc = train(spec, out, args)
        wait(lambda: max_step(out) >= args.kill_at, proc, f"step {args.kill_at}")
        cluster.kill_host("h3")
        killed = {"t_s": time.time() - t0, "step": max_step(out)}
        wait(lambda: any(r.get("event") == "restart" and r.get("world_size") == 3 for r in records(out)), proc,
             "the restart without h3")
        left = next(r for r in records(out) if r.get("event") == "restart" and r.get("world_size") == 3)
        regrouped = {"t_s": time.time() - t0, "step": left["step"]}
        wait(lambda: max_step(out) >= left["step"] + args.back_after, proc, f"{args.back_after} steps on 3 hosts")
        cluster.restore_host("h3")
        restored = {"t_s": time.time() - t0, "step": max_step(out)}
        _, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"the elastic run failed: {err[-3000:]}")
        elastic_s = time.time() - t0
        control = work / "control"
        t1 = time.time()
        proc = train(spec, control, args)
        _, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"the control run failed: {err[-3000:]}")
        control_s = time.time() - t1
    finally:
        if built:
            cluster.down()
    return {"steps": args.steps, "kill_at": args.kill_at, "timeout_s": args.timeout, "killed": killed,
            "regrouped": regrouped, "restored": restored, "elastic_wall_s": elastic_s, "control_wall_s": control_s,
            "elastic": records(out), "control": records(control),
            "elastic_summary": json.loads((out / "summary.json").read_text()),
            "control_summary": json.loads((control / "summary.json").read_text())}


def segments(recs: list[dict]) -> list[tuple[int, list[dict]]]:
    """(world size, step records) from each start or restart to the next: the steps a restart replays
    from its checkpoint appear in both segments, as they ran."""
    out, world, cur = [], None, []
    for r in recs:
        if "event" in r:
            if cur:
                out.append((world, cur))
            world, cur = r.get("world_size"), []
        elif "loss" in r:
            cur.append(r)
    if cur:
        out.append((world, cur))
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, av) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {4: "tab:blue", 3: "tab:red"}
    for world, recs in segments(data["elastic"]):
        ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], color=colors.get(world, "k"), lw=0.8,
                label=f"{world} hosts")
    ax.plot([r["step"] for r in data["control"] if "loss" in r], [r["loss"] for r in data["control"] if "loss" in r],
            color="gray", lw=0.6, alpha=0.6, label="control, 4 hosts throughout")
    for key, text in (("killed", "h3 killed"), ("restored", "h3 restored")):
        ax.axvline(data[key]["step"], color="k", ls=":", lw=0.8)
        ax.annotate(text, (data[key]["step"], ax.get_ylim()[1]), fontsize=8, ha="left", va="top")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    ax.set(xlabel="step", ylabel="training loss", title="charlm on 4 emulated hosts, one leaves and comes back")
    for name, recs, style in (("elastic", data["elastic"], "-"), ("control", data["control"], "--")):
        val = [r for r in recs if "val_loss" in r]
        av.plot([r["step"] for r in val], [r["val_loss"] for r in val], style, marker="o", ms=3, label=name)
    av.set(xlabel="step", ylabel="validation loss", title="validation loss")
    av.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(data: dict, command: str) -> str:
    e, c = data["elastic_summary"], data["control_summary"]
    events = [r for r in data["elastic"] if "event" in r]
    lost = data["killed"]["step"] - data["regrouped"]["step"]
    val_e = {r["step"]: r["val_loss"] for r in data["elastic"] if "val_loss" in r}
    val_c = {r["step"]: r["val_loss"] for r in data["control"] if "val_loss" in r}
    common = sorted(set(val_e) & set(val_c))
    gap = max(abs(val_e[s] / val_c[s] - 1) for s in common) if common else float("nan")
    lines = [
        "# A host leaves and comes back during a run", "",
        f"Command: `{command}` (root; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). charlm, global batch 24, "
        f"{data['steps']} steps, fp32 gradients, 4 emulated hosts at 100 Mbit/s and 0.45 core, `--min-hosts 3 "
        f"--max-restarts 3`, collective timeout {data['timeout_s']:g} s. At step {data['killed']['step']} host h3 was "
        "killed (`thinwire cluster kill`: link down, processes SIGKILLed); after "
        f"{data['restored']['step'] - data['regrouped']['step']} steps on 3 hosts it was restored "
        "(`thinwire cluster restore`). The control trains the same steps on the same cluster with no host lost.", "",
        "| event | step | world size | from checkpoint of world size |", "|---|---:|---:|---:|"]
    for r in events:
        lines.append(f"| {r['event']} | {r['step']} | {r.get('world_size', '-')} | {r.get('checkpoint_world_size', '-')} |")
    lines += ["",
              f"- h3 killed at step {data['killed']['step']} ({data['killed']['t_s']:.0f} s into the run); the three "
              f"others went on from step {data['regrouped']['step']} (the last checkpoint: {lost} steps done again), "
              f"{data['regrouped']['t_s'] - data['killed']['t_s']:.0f} s after the kill (the collective timeout, "
              "then the rendezvous without h3).",
              f"- h3 restored at step {data['restored']['step']}; it joined at the next rendezvous and the run "
              f"finished with world size {e['world_size']}.",
              f"- Final validation loss {e['val_loss']:.4f} against the control's {c['val_loss']:.4f} "
              f"({e['val_loss'] / c['val_loss'] - 1:+.2%}); largest gap at any common evaluation {gap:.2%}. "
              f"Wall clock {data['elastic_wall_s']:.0f} s against {data['control_wall_s']:.0f} s.", "",
              "![loss](elastic.png)", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=100)
    p.add_argument("--back-after", type=int, default=60, help="steps on 3 hosts before h3 is restored")
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--timeout", type=float, default=20.0, help="collective timeout (s): how long until the others notice")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    data = run(args)
    command = " ".join([".venv/bin/python", "benchmarks/elastic.py", *(argv if argv is not None else sys.argv[1:])])
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "elastic.json").write_text(json.dumps(data, indent=1))
    plot(data, args.results / "elastic.png")
    (args.results / "elastic.md").write_text(markdown(data, command))
    print((args.results / "elastic.md").read_text())


if __name__ == "__main__":
    main()
