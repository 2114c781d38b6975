#!/usr/bin/env bash
# Interleaved A/B rounds of real Megatron-LM training per family, then the comparisons, all into $OUT.
# Usage (repo root, CUDA machine, MEGATRON_LM_PATH set; TE families need transformer_engine):
#   OUT=out bash scripts/megatron-ab.sh [FAMILY...]                 # runs, then the comparisons
#   OUT=out bash scripts/megatron-ab.sh --runs-only [FAMILY...]     # runs only (compare elsewhere later)
#   OUT=out bash scripts/megatron-ab.sh --compare-only [FAMILY...]  # logs already in $OUT
#   DRY_RUN=1 bash scripts/megatron-ab.sh [FAMILY...]  (or --dry-run): the order, commands and a wall-time estimate
# FAMILY (examples/megatron-h200/run.sh): gb-te-pad gb-te-graph gb-te gb-te-fp8 (GPU-bound shape; -pad and -graph
# at fixed shapes, rings at the planned depth), gb4-te-pad gb4-te-fp8-pad (the same at micro-batch 4: eager is
# GPU-bound on the H200), local te te-fp8 (tiny, host-bound). Default: gb-te-pad gb-te-graph. The rings arms
# exercise the expert ring at EP = 1 (--moe-bufreuse-ring-single-rank-expert; production leaves it unused there).
# ep2-gloo ep2-gloo-kept: EP = 2, two ranks sharing the one GPU over gloo (tiny, local spec); install() leaves the
# rings unused there (nothing waits pending-free), -kept keeps them (--moe-bufreuse-keep-unused-rings).
# ep2-gloo-overlap: EP = 2 over gloo with --overlap-moe-expert-parallel-comm (combined 1F1B), where install() uses
# the dispatch ring; each run also writes one allocator snapshot per rank (F-<arm>-K-snapshots/rank<R>.pickle).
# hep hep-fp8 hep-fp8e hep-fp8d: real DeepEP HybridEP at EP = 2 on one GPU (run.sh's header): bf16 with the expert
# ring; FP8 with both rings, the expert ring alone, the dispatch ring alone; per-rank snapshots as above.
# Environment: ROUNDS (3) rounds per family; round K runs control then rings for odd K, rings then control for
# even K (A B B A A B ...), rounds outermost, so every family advances one round at a time. ITERS (20)
# iterations per run, WARMUP (5) iterations dropped by every comparison, LIMIT (180) seconds per run (killed
# past it), BUDGET_S (0 = none) seconds from AB_T0 (epoch seconds; default: this script's start, so a device
# call can start the clock before its set-up): a run starts only if the longest run so far (EST_RUN_S,
# default 50, before the first) still fits, and its timeout never passes the budget; skipped runs are listed
# in ab-skipped.txt and only complete rounds are compared.
# Per family F it writes F-control-K.log / F-rings-K.log (K = 1..ROUNDS), then:
#   F-roundK.{txt,json}   bufreuse compare F-control-K F-rings-K (each round's own verdict and interval)
#   F-ab.{txt,json}       bufreuse compare over all runs, baseline F-control-1, in run order
#   F-driftK.{txt,json}   F-control-K vs F-control-(K+1) (the noise floor between neighbouring rounds)
#   F-drift.{txt,json}    F-control-1 vs the last control (the noise floor over the whole call)
#   F-losses.{txt,json}   scripts/compare_losses.py, control vs rings per round, iteration by iteration
#   F-losses-drift.{txt,json}  F-control-1 vs the last control's losses (TE is not bit-reproducible)
#   F-summary.json        scripts/megatron_ab_summary.py: per round each arm's median step time and the ratio,
#                         the verdicts and intervals, the drift figures (machine-readable)
# and for families whose runs write per-rank snapshots (ep2-gloo-overlap):
#   F-snapshotsK-control.txt, F-snapshotsK-rings.txt   bufreuse snapshot-report per arm of round K (its ranks
#                         combined); F-snapshotsK.jsonl: snapshot-report --json over both arms, one line per rank
#   F-pending.txt         one line per round, also printed: MoE pending-free at max active per rank (the
#                         snapshot-report categories other than "other") and max reserved per rank, control and rings
# Rounds of several calls or sessions (one --compare-only folder each) pool into one between-rounds interval:
#   python3 scripts/megatron_ab_summary.py --family F --pool DIR1 DIR2 ... [--json F-pooled.json]
# (refused unless every control run, and every rings run, logged the same command)
# Exit status: 0 when every command ran (whatever the verdicts or loss differences), 1 when a run or a
# comparison failed (a run that exits non-zero or times out, a log compare cannot read, a budget-skipped run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-out}
mkdir -p "$out"
export OUT=$out
ROUNDS=${ROUNDS:-3}
export ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
LIMIT=${LIMIT:-180}
BUDGET_S=${BUDGET_S:-0}
EST_RUN_S=${EST_RUN_S:-50}
mode=all
[ "${DRY_RUN:-0}" = 1 ] && mode=dry
case ${1:-} in
  --compare-only) mode=compare; shift ;;
  --runs-only) mode=runs; shift ;;
  --dry-run) mode=dry; shift ;;
esac
families=("$@")
[ ${#families[@]} -eq 0 ] && families=(gb-te-pad gb-te-graph)
bufreuse() { python3 -m bufreuse "$@"; }
status=0

run_name() {  # family arm -> run.sh's run name
  if [ "$1" = local ]; then echo "$2"; else echo "$1-$2"; fi
}

arms() {  # round -> its two arms in order: A B for odd rounds, B A for even ones
  if [ $(($1 % 2)) = 1 ]; then echo control rings; else echo rings control; fi
}

plan=()  # "family arm round" in run order
for ((k = 1; k <= ROUNDS; k++)); do
  for f in "${families[@]}"; do
    for arm in $(arms "$k"); do
      plan+=("$f $arm $k")
    done
  done
done

if [ "$mode" = dry ]; then
  startup=${EST_STARTUP_S:-35}
  step=${EST_STEP_S:-0.2}
  echo "== order (${#plan[@]} runs, ROUNDS=$ROUNDS, ITERS=$ITERS, LIMIT=${LIMIT}s each, BUDGET_S=$BUDGET_S):"
  for p in "${plan[@]}"; do
    read -r f arm k <<<"$p"
    echo "$f-$arm-$k"
  done
  for p in "${plan[@]}"; do
    read -r f arm k <<<"$p"
    LIMIT=$LIMIT DRY_RUN=1 bash examples/megatron-h200/run.sh "$(run_name "$f" "$arm")@$f-$arm-$k" || status=1
  done
  python3 - "${#plan[@]}" "$startup" "$step" "$ITERS" "${#families[@]}" "$ROUNDS" <<'EOF'
import sys
runs, startup, step, iters, families, rounds = (float(a) for a in sys.argv[1:])
per_run = startup + iters * step
compare = families * (2 * (2 * rounds + 1) + 4) * 1.5  # ~1.5 s per `bufreuse compare` / loss script start
print(f"== estimate: {int(runs)} runs x ({startup:.0f} s start-up and exit + {iters:.0f} x {step} s) = "
      f"{runs * per_run:.0f} s of runs, + about {compare:.0f} s of comparisons = {runs * per_run + compare:.0f} s "
      f"(EST_STARTUP_S, EST_STEP_S; start-up measured on the H200 from the 2026-12-03 TE logs: ~24 s to "
      f"Megatron's library set-up, ~8 s to iteration 1, ~3 s exit)")
EOF
  exit $status
fi

if [ "$mode" != compare ]; then
  t0=${AB_T0:-$(date +%s)}  # the budget's clock: AB_T0 (epoch seconds) when set before the device call's set-up
  longest=$EST_RUN_S measured=0  # the longest run: EST_RUN_S until the first run has been timed
  rm -f "$out/ab-skipped.txt"
  printf '%s\n' "${plan[@]}" >"$out/ab-order.txt"
  for p in "${plan[@]}"; do  # no stale log of an earlier call may stand in for a skipped run
    read -r f arm k <<<"$p"
    rm -f "$out/$f-$arm-$k.log"
  done
  for p in "${plan[@]}"; do
    read -r f arm k <<<"$p"
    limit=$LIMIT
    if [ "$BUDGET_S" -gt 0 ]; then
      left=$((BUDGET_S - ($(date +%s) - t0)))
      if [ "$left" -lt "$longest" ]; then
        echo "== budget: $f-$arm-$k skipped (${left}s left of BUDGET_S=$BUDGET_S, a run takes up to ${longest}s)" \
          | tee -a "$out/ab-skipped.txt"
        status=1
        continue
      fi
      [ "$left" -lt "$limit" ] && limit=$left
    fi
    start=$SECONDS
    LIMIT=$limit bash examples/megatron-h200/run.sh "$(run_name "$f" "$arm")@$f-$arm-$k" || status=1
    took=$((SECONDS - start))
    if [ $measured = 0 ] || [ "$took" -gt "$longest" ]; then longest=$took; fi
    measured=1
    echo "== $f-$arm-$k took ${took}s ($(($(date +%s) - t0))s since the budget's clock started)"
  done
  [ "$mode" = runs ] && exit $status
fi

compare() {  # stem logs...: table and JSON of one `bufreuse compare`
  local stem=$1
  shift
  bufreuse compare --warmup "$WARMUP" "$@" >"$out/$stem.txt" 2>&1 || status=1
  bufreuse compare --warmup "$WARMUP" --json "$@" >"$out/$stem.json" 2>"$out/$stem.json.err" || status=1
  [ -s "$out/$stem.json.err" ] || rm -f "$out/$stem.json.err"
  echo "== $stem"
  cat "$out/$stem.txt"
}

snapshot_reports() {  # family rounds: snapshot-report over each round's rank snapshots, then the pending-free line
  local f=$1 rounds=$2 k arm d files
  rm -f "$out/$f-pending.txt"
  for ((k = 1; k <= rounds; k++)); do
    files=()
    for arm in control rings; do
      d=$out/$f-$arm-$k-snapshots
      if ! compgen -G "$d/rank*.pickle*" >/dev/null; then
        echo "== $f round $k: no snapshot in $d (the run did not finish?)" | tee -a "$out/$f-pending.txt" >&2
        status=1
        continue 2
      fi
      files+=("$d"/rank*.pickle*)
      # the table per arm, its ranks combined (they share the one GPU)
      bufreuse snapshot-report "$d"/rank*.pickle* >"$out/$f-snapshots$k-$arm.txt" 2>&1 || status=1
      echo "== $f-snapshots$k-$arm"
      cat "$out/$f-snapshots$k-$arm.txt"
    done
    bufreuse snapshot-report --json "${files[@]}" >"$out/$f-snapshots$k.jsonl" 2>"$out/$f-snapshots$k.err" || status=1
    [ -s "$out/$f-snapshots$k.err" ] || rm -f "$out/$f-snapshots$k.err"
    python3 - "$out/$f-snapshots$k.jsonl" "$f round $k" <<'EOF' | tee -a "$out/$f-pending.txt"
import json, re, sys
arms = {"control": {}, "rings": {}}
for line in open(sys.argv[1]).read().splitlines():
    if line.strip():
        d = json.loads(line)
        folder, name = d["file"].replace("\\", "/").split("/")[-2:]
        arm = re.search(r"-(control|rings)-\d+-snapshots$", folder).group(1)
        ring = ("dispatch_output", "expert_output")  # what a ring replaces (moe_other: combine outputs, gradients)
        moe = sum(v for k, v in d["pending_free_by_category_at_max_active"].items() if k in ring)
        arms[arm][int(re.match(r"rank(\d+)", name).group(1))] = (moe, d["max_reserved_bytes"], d["recording"])
if not arms["control"] or not arms["rings"]:
    sys.exit(f"== {sys.argv[2]}: snapshot-report gave no report for an arm")
def col(arm, i):
    return " / ".join(f"{v[i] / 2**20:,.1f}" for _, v in sorted(arms[arm].items()))
off = [a for a, r in arms.items() if not all(v[2] for v in r.values())]
print(f"== {sys.argv[2]}: MoE pending-free at max active per rank (MiB): control {col('control', 0)}, rings "
      f"{col('rings', 0)}; max reserved per rank (MiB): control {col('control', 1)}, rings {col('rings', 1)}"
      + (f"; NO HISTORY in {', '.join(off)} (final state only)" if off else ""))
EOF
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
}

for f in "${families[@]}"; do
  # complete rounds only: both arms' logs there, in round order
  rounds=0
  while [ $rounds -lt "$ROUNDS" ] && [ -f "$out/$f-control-$((rounds + 1)).log" ] \
    && [ -f "$out/$f-rings-$((rounds + 1)).log" ]; do
    rounds=$((rounds + 1))
  done
  if [ $rounds = 0 ]; then
    echo "== $f: no complete round in $out (need $f-control-1.log and $f-rings-1.log)" >&2
    status=1
    continue
  fi
  [ $rounds -lt "$ROUNDS" ] && echo "== $f: $rounds of ROUNDS=$ROUNDS rounds complete in $out; comparing those"
  logs=()  # in run order: A B B A A B ...
  controls=()
  pairs=()  # control rings, per round
  for ((k = 1; k <= rounds; k++)); do
    c=$out/$f-control-$k.log
    r=$out/$f-rings-$k.log
    if [ $((k % 2)) = 1 ]; then logs+=("$c" "$r"); else logs+=("$r" "$c"); fi
    controls+=("$c")
    pairs+=("$c" "$r")
    compare "$f-round$k" "$c" "$r"
  done
  compare "$f-ab" "${controls[0]}" "${logs[@]:1}"
  for ((k = 1; k < rounds; k++)); do
    compare "$f-drift$k" "${controls[k - 1]}" "${controls[k]}"
  done
  [ $rounds -gt 1 ] && compare "$f-drift" "${controls[0]}" "${controls[rounds - 1]}"
  python3 scripts/compare_losses.py --json "$out/$f-losses.json" "${pairs[@]}" >"$out/$f-losses.txt" 2>&1
  [ $? -le 1 ] || status=1  # 1 = losses differ: a finding, reported in F-losses.txt, not a failed command
  echo "== $f-losses"
  cat "$out/$f-losses.txt"
  if [ $rounds -gt 1 ]; then
    # the loss noise floor: the same configuration twice (TE's kernels are not bit-reproducible run to run)
    python3 scripts/compare_losses.py --json "$out/$f-losses-drift.json" "${controls[0]}" "${controls[rounds - 1]}" \
      >"$out/$f-losses-drift.txt" 2>&1
    [ $? -le 1 ] || status=1
    echo "== $f-losses-drift"
    tail -1 "$out/$f-losses-drift.txt"
  fi
  echo "== $f-summary ($f-summary.json)"
  python3 scripts/megatron_ab_summary.py --out "$out" --family "$f" --rounds "$rounds" --json "$out/$f-summary.json" \
    || status=1
  # families that record per-rank snapshots (a missing one is then a failed run, reported)
  if [[ $f == ep2-gloo-overlap* || $f == hep* ]] || [ -d "$out/$f-control-1-snapshots" ]; then
    snapshot_reports "$f" "$rounds"
  fi
done
exit $status
