#!/usr/bin/env bash
# On the lent H200 (one device call): the proxy's GPU tests, the examples/sweep-h200 recording and
# the benchmark figures, all into $OUT (gpu-tests.log, sweep.log, examples.tgz, bench-proxy.json,
# bench.log, gpu.txt). Each part has its own time limit so one failure does not eat the others' time.
# Usage (repo root): bash scripts/record-proxy-h200.sh [BENCH_BUDGET_S]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/device-env.sh
source scripts/device-env.sh
out=${OUT:-out}
mkdir -p "$out"
budget=${1:-120}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' >>"$out/gpu.txt" 2>&1

echo "== 1. gpu tests $(date -u +%T)"
timeout 200 bash scripts/gpu-tests.sh tests/test_proxy_gpu.py -x -q
echo "gpu-tests rc=$?"

echo "== 2. examples recording $(date -u +%T)"
rm -rf examples/sweep-h200
timeout 150 bufreuse sweep --slots 0,2,4,10 --modes stream-ordered --root examples --name sweep-h200 \
  --timeout 120 >"$out/sweep.log" 2>&1
echo "sweep rc=$?"
tail -20 "$out/sweep.log"
tar czf "$out/examples.tgz" examples/sweep-h200

echo "== 3. benchmark $(date -u +%T)"
timeout $((budget + 90)) python3 -m bufreuse.bench.sweep_bench --out "$out/bench-proxy.json" --repeats 5 \
  --budget-s "$budget" >"$out/bench.log" 2>&1
echo "bench rc=$?"
tail -25 "$out/bench.log"
echo "== done $(date -u +%T)"
