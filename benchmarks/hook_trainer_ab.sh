#!/usr/bin/env bash
# thinwire's bf16 hook against PyTorch's bf16_compress_hook through the same trainer: charlm as in auto_focus.md
# (2 layers, width 128, 4 heads, context 64), global batch 32, 4 local workers on loopback (no link shaping),
# 300 steps, 4 rounds with the contenders interleaved. Prints: contender, round, median step ms, wall s.
# Usage: bash benchmarks/hook_trainer_ab.sh [OUT_FOLDER]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d /tmp/hook-ab-XXXX)}
for r in 1 2 3 4; do
  for c in torch:bf16 bf16; do
    o="$out/$(echo "$c" | tr ':' '_')-$r"
    .venv/bin/thinwire train --workload charlm --set model.layers=2 --set model.width=128 --set model.heads=4 \
      --set model.context=64 --batch-size 32 --nproc 4 --steps 300 --eval-every 1000 --threads 1 --compression "$c" \
      --out "$o" > /dev/null 2>&1
    .venv/bin/python -c "import json, sys; s = json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], \
round(1e3 * s['median_step_time_s'], 2), round(s['wall_s'], 2))" "$o/summary.json" "$c" "$r"
  done
done
