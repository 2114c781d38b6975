#!/usr/bin/env bash
# Memory at EP >= 2 on the one H200 (issue 40, item 3): every arm of scripts/ep_memory.py at EP = 2 (EP = 4 too
# with EP4=1), 2 (4) processes sharing GPU 0 over gloo, then the analysis commands on their snapshots; everything
# under $OUT (one tarball per EP size plus the summaries as plain files). About 5 minutes at the defaults.
#
#   source scripts/device-env.sh            # megatron-core from the carried .whl
#   OUT=$OUT bash scripts/ep-memory-device.sh
#
# Arms: control (megatron as is: record_stream where megatron records), rings and stream-ordered as install()
# leaves them (at EP >= 2 without EP overlap the stream rule leaves both rings unused: the run shows that), and
# rings-kept / stream-ordered-kept (moe_bufreuse_keep_unused_rings, the validation knob: what the rings cost where
# nothing waits). Knobs: EP4=1, SPEC=local|te, PAD=1 (capacity 1.0), SHAPE="--hidden 4096 --ffn 2048 --tokens 4096
# --experts 16 --topk 4" (default: the issue's small shape), STEPS (3), SLOTS (2), DRY_RUN=1 (print, run nothing).
# Gloo stages through host memory on its own stream, so these step times are not NCCL's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
SPEC=${SPEC:-local}
STEPS=${STEPS:-3}
SLOTS=${SLOTS:-2}
SHAPE=${SHAPE:---hidden 1024 --ffn 2048 --tokens 2048 --experts 8 --topk 2}
PADARG=""
[ "${PAD:-0}" = 1 ] && PADARG="--pad"
t0=$SECONDS
log() { echo "== $(date -u +%H:%M:%S) (+$((SECONDS - t0)) s) $*" | tee -a "$OUT/ep-memory-timeline.txt"; }
run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "DRY_RUN: $*"; return 0; fi
  "$@"
}
sizes="2"
[ "${EP4:-0}" = 1 ] && sizes="2 4"
rc=0
for ep in $sizes; do
  dir=/tmp/ep-memory/ep$ep
  rm -rf "$dir" && mkdir -p "$dir"
  for arm in "control" "rings" "stream-ordered" "rings --keep-unused" "stream-ordered --keep-unused"; do
    log "EP $ep: $arm"
    # shellcheck disable=SC2086
    run timeout 240 torchrun --standalone --nproc-per-node "$ep" scripts/ep_memory.py --out "$dir" --arm $arm \
      --backend gloo --spec "$SPEC" --steps "$STEPS" --slots "$SLOTS" $PADARG $SHAPE >"$dir/log-${arm// /}.txt" 2>&1 \
      || { log "EP $ep: $arm failed (tail below)"; tail -n 30 "$dir/log-${arm// /}.txt"; rc=1; }
  done
  log "EP $ep: summary"
  run python3 scripts/ep_memory.py --summarize "$dir" | tee "$OUT/ep$ep-summary.txt" || rc=1
  snaps=$(ls "$dir"/control/rank*.pickle 2>/dev/null | tr '\n' ' ')
  if [ -n "$snaps" ] || [ "${DRY_RUN:-0}" = 1 ]; then
    log "EP $ep: snapshot-report over every rank of every arm"
    # shellcheck disable=SC2086
    run bufreuse snapshot-report --json "$dir"/*/rank*.pickle >"$OUT/ep$ep-snapshot-report.jsonl" || rc=1
    run bufreuse snapshot-report "$dir"/control/rank*.pickle "$dir"/rings-kept/rank*.pickle \
      >"$OUT/ep$ep-snapshot-report.txt" 2>&1 || rc=1
    run python3 scripts/ep_memory.py --combine "$OUT/ep$ep-snapshot-report.jsonl" | tee "$OUT/ep$ep-combined.txt"
    for r in $(seq 0 $((ep - 1))); do
      log "EP $ep rank $r: what-if on the control against the measured kept-ring run; advise"
      run bufreuse what-if "$dir/control/rank$r.pickle" --slots "$SLOTS,4" \
        --measured "$SLOTS=$dir/rings-kept/rank$r.pickle" >"$OUT/ep$ep-rank$r-what-if.txt" 2>&1 || rc=1
      run bufreuse advise "$dir/control/rank$r.pickle" --num-microbatches 4 \
        >"$OUT/ep$ep-rank$r-advise.txt" 2>&1 || rc=1
    done
  fi
  [ "${DRY_RUN:-0}" = 1 ] || tar -C /tmp/ep-memory -czf "$OUT/ep$ep.tgz" "ep$ep"
done
log "done (rc=$rc)"
exit $rc
