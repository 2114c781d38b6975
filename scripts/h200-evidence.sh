#!/usr/bin/env bash
# The H200 evidence of one device session, by stage, every output tarred into $OUT (the device returns a few
# files per call, so each stage leaves one archive). Run from the repo root on the lent H200, after the TE parts
# are staged (scripts/device-te.sh); carry [".te-device/w", ".whl", ".mlm", ".deepep"] as the stage needs.
#
#   bash scripts/h200-evidence.sh tests         # TE install; every gpu-marked test
#   bash scripts/h200-evidence.sh bench NAME... # `bench layer` runs by name ([old-]host|gpu-pad|dropless-bf16|fp8);
#                                               # ROUNDS (10), STEPS, GC=manual, POLICIES, DISPATCH_RING=1
#                                               # (--dispatch-ring) tune it
#   bash scripts/h200-evidence.sh tests-bench   # TE install; DeepEP build in the background; every gpu-marked
#                                               # test; the HybridEP probe + test; `bench layer` at both presets
#   AB_T0=$(date +%s) BUDGET_S=540 bash scripts/h200-evidence.sh ab ROUND_FROM ROUND_TO [FAMILY...]
#                                               # Megatron-LM A/B rounds ROUND_FROM..ROUND_TO (default families
#                                               # gb-te-pad gb-te-graph), ITERS=60 per run, logs tarred
#   bash scripts/h200-evidence.sh ep            # expert parallelism over gloo, 2 (4) ranks on the one GPU, no TE
#                                               # needed (carry .whl .mlm): the Megatron-LM EP-overlap family
#                                               # (per-rank snapshots, pending-free at max active), the EP gloo
#                                               # GPU tests (te ones too when TE is staged), the layer memory probe
#   bash scripts/h200-evidence.sh prof FAMILY...  # torch-profiler runs control, rings, rings, control of each
#                                               # family and their trace_summary comparisons (PROF_ITERS ...)
# Compare locally afterwards: OUT=<untarred logs> ROUNDS=R WARMUP=10 bash scripts/megatron-ab.sh --compare-only F...
# and pool sessions: python3 scripts/megatron_ab_summary.py --family F --pool DIR1 DIR2 ...
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
stage=${1:?stage: tests, bench, tests-bench, ep, ab or prof}
shift
work=/tmp/evidence-$stage
rm -rf "$work" && mkdir -p "$work"
t0=$SECONDS
log() { echo "== $(date -u +%H:%M:%S) (+$((SECONDS - t0)) s) $*" | tee -a "$work/timeline.txt"; }

te_env() {
  # .txt, not .log: the A/B folders go to docs/recordings/ whole, where every *.log is read as a Megatron run
  bash scripts/device-te.sh install >"$work/te-install.txt" 2>&1 || log "TE install failed (see te-install.txt)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} BUFREUSE_REQUIRE_TE=1
  # shellcheck source=scripts/device-env.sh
  source scripts/device-env.sh
}

machine_facts() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv >"$work/gpu.csv" 2>&1
  lscpu >"$work/lscpu.txt" 2>&1
}

gpu_tests() {  # default timeout, seconds (TESTS_TIMEOUT overrides)
  log "gpu-marked tests"
  OUT=$work timeout -k 10 "${TESTS_TIMEOUT:-$1}" bash scripts/gpu-tests.sh ${TEST_ARGS:-} >/dev/null 2>&1
  log "gpu tests exit $? : $(grep -E '^=+ .* in [0-9.]+s' "$work/gpu-tests.log" | tail -1)"
}

case $stage in
  tests-bench)
    log "TE install"
    te_env
    machine_facts
    if [ -d .deepep/src ]; then
      log "DeepEP hybrid-ep build (background)"
      OUT=$work bash scripts/hybridep-device.sh build >"$work/hybridep-build-bg.log" 2>&1 &
      build_pid=$!
    fi
    gpu_tests 260
    if [ -n "${build_pid:-}" ]; then
      wait "$build_pid"; log "DeepEP build exit $?"
      OUT=$work TOTAL_TIMEOUT=${HYBRIDEP_TIMEOUT:-150} timeout -k 10 "${HYBRIDEP_TIMEOUT:-150}" \
        bash scripts/hybridep-device.sh run >"$work/hybridep-run.log" 2>&1
      log "HybridEP run exit $? : $(cat "$work/hybridep-status.txt" 2>/dev/null | head -1)"
    fi
    bl() {  # name, bench layer arguments...
      local name=$1; shift
      log "bench layer $name"
      timeout -k 10 150 python3 -m bufreuse bench layer "$@" --json --output "$work/bl-$name.json" \
        --plot "$work/bl-$name.png" >"$work/bl-$name.log" 2>&1 || log "bench layer $name exit $?"
    }
    bl host-pad-bf16 --preset host-bound --spec te --pad --rounds 20
    bl host-bf16 --preset host-bound --spec te --rounds 10
    bl host-pad-fp8 --preset host-bound --spec te --precision fp8 --pad --rounds 10
    bl gpu-pad-bf16 --preset gpu-bound --spec te --pad --rounds 10
    ;;
  tests)
    log "TE install"
    te_env
    machine_facts
    gpu_tests 300
    ;;
  ep)
    # shellcheck source=scripts/device-env.sh
    source scripts/device-env.sh
    [ -f .te-device/w/install-on-device.sh ] && te_env
    machine_facts
    log "Megatron-LM EP 2 over gloo, EP overlap (control, rings)"
    MEGATRON_LM_PATH=${MEGATRON_LM_PATH:-$PWD/.mlm} ROUNDS=${ROUNDS:-1} ITERS=${ITERS:-20} WARMUP=${WARMUP:-5} \
      LIMIT=${LIMIT:-200} OUT=$work/ab timeout -k 10 "${AB_TIMEOUT:-290}" bash scripts/megatron-ab.sh ep2-gloo-overlap \
      >"$work/ab-console.txt" 2>&1 || log "EP overlap family exit $?"
    find "$work/ab" -name '*.pickle' -delete 2>/dev/null  # analysed on the device; too large to bring back
    log "EP gloo GPU tests"
    TEST_ARGS="tests/test_ep_gloo_gpu.py" gpu_tests 200
    log "layer memory probe, EP 2 (EP4=1: and 4)"
    OUT=$work/epmem timeout -k 10 "${EPMEM_TIMEOUT:-200}" bash scripts/ep-memory-device.sh >"$work/epmem.txt" 2>&1 \
      || log "memory probe exit $?"
    rm -f "$work"/epmem/*.tgz
    ;;
  bench)
    # NAME... : [old-]PRESET-ROUTING-PRECISION, e.g. host-pad-bf16, old-host-pad-bf16, gpu-pad-fp8, host-dropless-bf16;
    # old- runs the checkout in .old/ (carry it) with the same arguments, for a before/after of the same method
    # (OLD_ARGS=same: the flags newer than some old checkouts too: GC, POLICIES)
    te_env
    declare -A seen=()
    for arg in "$@"; do
      # a repeated NAME (A B B A order) gets -2, -3 ... on its outputs instead of overwriting the first run's
      seen[$arg]=$(( ${seen[$arg]:-0} + 1 ))
      name=$arg; [ "${seen[$arg]}" -gt 1 ] && name=$arg-${seen[$arg]}
      py=(python3); n=$arg
      # -P: the working directory (this checkout) does not shadow .old on sys.path
      if [[ $n == old-* ]]; then py=(env "PYTHONPATH=$PWD/.old:$PYTHONPATH" python3 -P); n=${n#old-}; fi
      IFS=- read -r preset routing precision <<<"$n"
      args=(--preset "$preset-bound" --spec te --precision "$precision" --rounds "${ROUNDS:-10}")
      [ "$routing" = pad ] && args+=(--pad)
      [ -n "${STEPS:-}" ] && args+=(--steps "$STEPS")
      [ -n "${GC:-}" ] && { [[ $arg != old-* ]] || [ "${OLD_ARGS:-}" = same ]; } && args+=(--gc "$GC")
      [ -n "${POLICIES:-}" ] && { [[ $arg != old-* ]] || [ "${OLD_ARGS:-}" = same ]; } && args+=(--policies "$POLICIES")
      [ "${DISPATCH_RING:-0}" = 1 ] && [[ $arg != old-* ]] && args+=(--dispatch-ring)  # old checkouts lack it
      log "bench layer $name"
      timeout -k 10 "${BENCH_TIMEOUT:-130}" "${py[@]}" -m bufreuse bench layer "${args[@]}" --json \
        --output "$work/bl-$name.json" --plot "$work/bl-$name.png" >"$work/bl-$name.log" 2>&1 || log "bench $name exit $?"
    done
    ;;
  prof)
    # FAMILY...: torch-profiler runs control, rings, rings, control (examples/megatron-h200/run.sh prof-*), then
    # scripts/trace_summary.py: each rings run against its neighbouring control, and control against control
    te_env
    export MEGATRON_LM_PATH=${MEGATRON_LM_PATH:-.mlm} LAUNCHER=${LAUNCHER:-torchrun}
    for f in "$@"; do
      k=0
      for arm in control rings rings control; do
        k=$((k + 1))
        log "prof $f-$arm ($k)"
        OUT=$work LIMIT=${PROF_LIMIT:-150} bash examples/megatron-h200/run.sh "prof-$f-$arm@prof-$f-$k-$arm" \
          >/dev/null 2>&1 || log "prof $f-$arm exit $?"
      done
      t() { echo "$work/prof-$f-$1/torch_profile/rank-0.json.gz"; }
      python3 scripts/trace_summary.py --compare "$(t 1-control)" "$(t 2-rings)" --json "$work/trace-$f-c1-r2.json" \
        >"$work/trace-$f-c1-r2.txt" 2>&1
      python3 scripts/trace_summary.py --compare "$(t 4-control)" "$(t 3-rings)" --json "$work/trace-$f-c4-r3.json" \
        >"$work/trace-$f-c4-r3.txt" 2>&1
      python3 scripts/trace_summary.py --compare "$(t 1-control)" "$(t 4-control)" --json "$work/trace-$f-c1-c4.json" \
        >"$work/trace-$f-c1-c4.txt" 2>&1
      python3 scripts/trace_summary.py --compare "$(t 2-rings)" "$(t 3-rings)" --json "$work/trace-$f-r2-r3.json" \
        >"$work/trace-$f-r2-r3.txt" 2>&1
      for k in 1-control 2-rings 3-rings 4-control; do
        python3 scripts/trace_summary.py "$(t $k)" --json "$work/trace-$f-$k-summary.json" >/dev/null 2>&1
      done
      for k in 1-control 2-rings 3-rings 4-control; do mv "$(t $k)" "$work/trace-$f-$k.json.gz" 2>/dev/null; done
      rm -rf "$work"/prof-"$f"-*/  # the traces moved out; tensorboard's folders are empty
    done
    ;;
  ab)
    from=${1:?first round}; to=${2:?last round}; shift 2
    AB_T0=${AB_T0:-$(date +%s)}   # the budget's clock: fixed once, before the first run
    te_env
    fams=("$@"); [ ${#fams[@]} -eq 0 ] && fams=(gb-te-pad gb-te-graph)
    export MEGATRON_LM_PATH=${MEGATRON_LM_PATH:-.mlm} ITERS=${ITERS:-60} LAUNCHER=${LAUNCHER:-torchrun}
    for ((k = from; k <= to; k++)); do
      for f in "${fams[@]}"; do
        if [ $((k % 2)) = 1 ]; then arms="control rings"; else arms="rings control"; fi
        for arm in $arms; do
          left=$(( ${BUDGET_S:-540} - ($(date +%s) - AB_T0) ))
          if [ "$left" -lt "${EST_RUN_S:-60}" ]; then log "budget: $f-$arm-$k skipped (${left}s left)"; continue; fi
          log "$f-$arm-$k"
          echo "$f $arm $k" >>"$work/ab-order.txt"
          OUT=$work LIMIT=$(( left < 180 ? left : 180 )) bash examples/megatron-h200/run.sh "$f-$arm@$f-$arm-$k" \
            >/dev/null 2>&1 || log "$f-$arm-$k exit $?"
          log "$f-$arm-$k: $(grep -c 'elapsed time per iteration' "$work/$f-$arm-$k.log" 2>/dev/null) iterations"
        done
      done
    done
    ;;
  *) sed -n '2,18p' "$0" >&2; exit 2 ;;
esac
log "done; tarring"
tar -czf "$OUT/$stage-$(date -u +%H%M%S).tar.gz" -C "$work" .
ls -la "$OUT"
