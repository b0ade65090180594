"""Aggregation in the switch against the ring, an int8 all-reduce of a gradient on an emulated cluster
(issue 24's first switch item: 8 hosts x 100 Mbit/s, at least 1.5x faster with the switch).

    sudo .venv/bin/python benchmarks/switch_bench.py                  # 8 x 100 Mbit/s, 3 passes (~3 min)
    sudo .venv/bin/python benchmarks/switch_bench.py --hosts 4 --rate 1gbit --name switch_bench_4x1gbit

The cluster: ``--hosts`` hosts at ``--rate`` each, no CPU cap on the hosts (they share this machine's
cores), and an aggregator on the switch with ``--switch-cpu`` cores of its own. Each pass is one
``thinwire cluster bench SPEC --aggregation switch``: per gradient size, an int8 all-reduce around the ring
(thinwire's ``--compression int8``: compressed reduce-scatter + all-gather) and through the aggregator,
alternating rep by rep; a rep's time is the slowest host's, encoding and decoding included. Passes
repeat the whole thing (the machine's speed drifts); the table gives each size's median over passes of
the per-pass medians, and the speed-up per pass. The model's price of both (the bytes each host sends at
the link's rate less TCP's headers, no latency) is given beside, for scale. Writes ``--name``.{json,md}
into ``--out``.
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

from thinwire.compress import schemes  # noqa: E402
from thinwire.compress.spec import parse_codec_spec  # noqa: E402
from thinwire.measure.file import TCP_EFFICIENCY  # noqa: E402
from thinwire.units import parse_rate  # noqa: E402

SIZES = "1792KiB,8MiB,32MiB"  # charlm's gradient at compare.py's model (0.45M values), then larger ones


def spec_text(hosts: int, rate: str, switch_cpu: float) -> str:
    lines = [f"name: swb-{hosts}h", "subnet: 10.216.0.0/24", f"defaults: {{bandwidth: {rate}}}",
             f"switch: {{cpu: {switch_cpu if switch_cpu > 0 else 'null'}}}", "hosts:"]
    return "\n".join(lines + [f"  - {{name: h{i}}}" for i in range(hosts)]) + "\n"


def wire_s(nbytes: int, hosts: int, rate_bps: float, switch: bool) -> float:
    """Seconds the bytes one host sends take at the link's payload rate (what the model's bandwidth term gives)."""
    t = schemes.traffic(parse_codec_spec("int8"), nbytes // 4, hosts, switch=switch)
    return t.bytes_sent * 8 / (rate_bps * TCP_EFFICIENCY)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--switch-cpu", type=float, default=0.5, help="the aggregator's cores (0: no cap)")
    ap.add_argument("--sizes", default=SIZES, help="gradient sizes in fp32 bytes")
    ap.add_argument("--reps", type=int, default=5, help="reps per size and way in one pass")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--name", default="switch_bench")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("switch_bench.py needs root for the emulated cluster (network namespaces, tc, cgroups). Run it with sudo.")
        return 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    passes = []
    with tempfile.TemporaryDirectory(prefix="switch_bench-") as tmp:
        spec = Path(tmp) / "spec.yaml"
        spec.write_text(spec_text(args.hosts, args.rate, args.switch_cpu))
        tw = [sys.executable, "-m", "thinwire", "cluster"]
        subprocess.run([*tw, "up", str(spec)], check=True, env=env, capture_output=True)
        try:
            for k in range(args.passes):
                r = subprocess.run([*tw, "bench", str(spec), "--aggregation", "switch", "--sizes", args.sizes,
                                    "--reps", str(args.reps), "--json"], capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    raise SystemExit(f"pass {k}: cluster bench failed:\n{r.stderr[-3000:]}")
                passes.append(json.loads(r.stdout.strip().splitlines()[-1]))
                print(f"pass {k}: " + ", ".join(f"{n / 2**20:.2f} MiB {s:.2f}x" for n, s in
                                               zip(passes[-1]["sizes"], passes[-1]["speedups"])), flush=True)
        finally:
            subprocess.run([*tw, "down", str(spec)], env=env, capture_output=True)
    rate = parse_rate(args.rate, "--rate")
    sizes = passes[0]["sizes"]
    rows = []
    for i, n in enumerate(sizes):
        ring = statistics.median(p["ring_s"][i] for p in passes)
        sw = statistics.median(p["switch_s"][i] for p in passes)
        rows.append({"bytes": n, "ring_s": ring, "switch_s": sw, "speedup": ring / sw,
                     "speedups": [p["speedups"][i] for p in passes],
                     "wire_ring_s": wire_s(n, args.hosts, rate, False), "wire_switch_s": wire_s(n, args.hosts, rate, True)})
    data = {"command": "sudo .venv/bin/python benchmarks/switch_bench.py " + " ".join(sys.argv[1:]), "commit": commit,
            "started": started, "ended": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "hosts": args.hosts,
            "rate": args.rate, "switch_cpu": args.switch_cpu, "reps": args.reps, "passes": passes, "rows": rows}
    out = Path(args.out)
    (out / f"{args.name}.json").write_text(json.dumps(data, indent=1))
    lines = [f"# Aggregation in the switch against the ring: int8 all-reduce, {args.hosts} hosts x {args.rate}", "",
             f"Command: `{data['command']}`  ",
             f"Run {started} to {data['ended']} UTC, commit {commit}. {args.hosts} emulated hosts at {args.rate} each "
             f"(no CPU cap; they share this machine's cores), an aggregator on the switch with "
             f"{f'{args.switch_cpu} core of its own' if args.switch_cpu > 0 else 'no CPU cap'}. {args.passes} passes of `thinwire cluster bench SPEC --aggregation switch --reps {args.reps}`:"
             " per size, the ring's int8 all-reduce (thinwire's `--compression int8`: compressed reduce-scatter + "
             "all-gather) and the switch's, alternating rep by rep; a rep's time is the slowest host's, encode and "
             "decode included. Times: median over passes of each pass's median. 'wire' is what the bytes each host "
             "sends take at the link's payload rate, no latency (the model's bandwidth term).", "",
             "| gradient (fp32) | ring (ms) | switch (ms) | switch speed-up | per pass | wire: ring / switch (ms) |",
             "|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['bytes'] / 2**20:.2f} MiB | {1e3 * r['ring_s']:.1f} | {1e3 * r['switch_s']:.1f} | "
                     f"**{r['speedup']:.2f}x** | {', '.join(f'{x:.2f}x' for x in r['speedups'])} | "
                     f"{1e3 * r['wire_ring_s']:.1f} / {1e3 * r['wire_switch_s']:.1f} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
