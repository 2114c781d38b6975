#!/usr/bin/env bash
# On the lent H200 after the TE parts (scripts/device-te.sh): scripts/hook_breakdown.py at the host-bound preset,
# TE, pad routing, bf16 and FP8; JSON and the printed tables into $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
bash scripts/device-te.sh install >"$OUT/te-install.log" 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# shellcheck source=scripts/device-env.sh
source scripts/device-env.sh
for p in bf16 fp8; do
  timeout -k 5 "${PER_RUN_S:-100}" python3 scripts/hook_breakdown.py --preset host-bound --spec te --pad --precision "$p" \
    --repeats "${REPEATS:-5}" --json "$OUT/hook-breakdown-$p.json" 2>"$OUT/hook-breakdown-$p.err" | tee "$OUT/hook-breakdown-$p.txt"
done
