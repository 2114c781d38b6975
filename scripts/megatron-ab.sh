#!/usr/bin/env bash
# A B A B real-Megatron runs per family, then the comparisons, all into $OUT (default ./out).
# Usage (repo root, CUDA machine, MEGATRON_LM_PATH set; TE families need transformer_engine):
#   OUT=out bash scripts/megatron-ab.sh [FAMILY...]     # FAMILY: local te te-fp8 (default: te te-fp8)
#   OUT=out bash scripts/megatron-ab.sh --compare-only [FAMILY...]   # logs already in $OUT
# Per family F it writes F-{control,rings}-{1,2}.log (examples/megatron-h200/run.sh ab-F), then:
#   F-ab.txt / F-ab.json     bufreuse compare F-control-1 F-rings-1 F-control-2 F-rings-2 (baseline first)
#   F-round1.{txt,json}, F-round2.{txt,json}   each round's control vs rings
#   F-drift.{txt,json}       F-control-1 vs F-control-2 (the noise floor: same config, later in time)
#   F-losses.{txt,json}      scripts/compare_losses.py, control vs rings per round, iteration by iteration
#   F-losses-drift.{txt,json} F-control-1 vs F-control-2 losses (the loss noise floor of the same config)
# Exit status: 0 when every command ran (whatever the verdicts or loss differences), 1 when a run or a
# comparison failed (a run that exits non-zero, a log compare cannot read).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-out}
mkdir -p "$out"
export OUT=$out
WARMUP=${WARMUP:-5}
compare_only=0
if [ "${1:-}" = --compare-only ]; then
  compare_only=1
  shift
fi
families=("$@")
[ ${#families[@]} -eq 0 ] && families=(te te-fp8)
bufreuse() { python3 -m bufreuse "$@"; }
status=0

compare() {  # stem logs...: table and JSON of one `bufreuse compare`
  local stem=$1
  shift
  bufreuse compare --warmup "$WARMUP" "$@" >"$out/$stem.txt" 2>&1 || status=1
  bufreuse compare --warmup "$WARMUP" --json "$@" >"$out/$stem.json" 2>"$out/$stem.json.err" || status=1
  [ -s "$out/$stem.json.err" ] || rm -f "$out/$stem.json.err"
  echo "== $stem"
  cat "$out/$stem.txt"
}

for f in "${families[@]}"; do
  if [ $compare_only = 0 ]; then
    bash examples/megatron-h200/run.sh "ab-$f" || status=1
  fi
  logs=()
  for round in 1 2; do
    for arm in control rings; do
      logs+=("$out/$f-$arm-$round.log")
    done
  done
  compare "$f-ab" "${logs[@]}"
  compare "$f-round1" "${logs[0]}" "${logs[1]}"
  compare "$f-round2" "${logs[2]}" "${logs[3]}"
  compare "$f-drift" "${logs[0]}" "${logs[2]}"
  python3 scripts/compare_losses.py --json "$out/$f-losses.json" \
    "${logs[0]}" "${logs[1]}" "${logs[2]}" "${logs[3]}" >"$out/$f-losses.txt" 2>&1
  [ $? -le 1 ] || status=1  # 1 = losses differ: a finding, reported in F-losses.txt, not a failed command
  echo "== $f-losses"
  cat "$out/$f-losses.txt"
  # the loss noise floor: the same configuration twice (TE's kernels are not bit-reproducible run to run)
  python3 scripts/compare_losses.py --json "$out/$f-losses-drift.json" "${logs[0]}" "${logs[2]}" \
    >"$out/$f-losses-drift.txt" 2>&1
  [ $? -le 1 ] || status=1
  echo "== $f-losses-drift"
  tail -1 "$out/$f-losses-drift.txt"
done
exit $status
