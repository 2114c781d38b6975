#!/usr/bin/env bash
# The seed's configuration on the lent GPU: real DeepEP HybridEP at EP = 2 (two processes sharing the GPU over
# gloo), real Megatron-LM and Transformer Engine, control against the rings. Three stages, one device call each,
# back to back (the machine keeps /tmp only while it stays warm); everything lands in $OUT.
#   here, once:  bash scripts/device-te.sh prepare (then `halves` if the tree + a part pass 64 MiB);
#                bash scripts/hybridep-device.sh prepare; bash scripts/fetch-device-wheels.sh;
#                bash scripts/fetch-megatron-lm.sh
#   the five (or nine) TE part calls of scripts/device-te.sh, then:
#   setup    carry [.te-device/w, .deepep, .whl, .mlm]: install TE and megatron-core into /tmp/site, build DeepEP
#            hybrid-ep with bufreuse's output_token edit (scripts/deepep_output_token.py), the real-kernel tests
#            at world sizes 1 and 2, and `bufreuse plan` on the families' arguments (the prediction, before runs)
#   ab       carry the same: scripts/megatron-ab.sh over the HEP_FAMILIES (default: hep-fp8 hep-fp8e hep-fp8d,
#            ROUNDS=1: control, rings per family, interleaved), per-rank snapshots and their reports
#   tests    carry the same: the gpu-marked suite with real TE (scripts/gpu-tests.sh)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT=${OUT:-out}
mkdir -p "$OUT"
# shellcheck source=scripts/device-env.sh
source scripts/device-env.sh
[ -d /tmp/te ] || [ -d /tmp/site/transformer_engine ] && bash scripts/device-te.sh install >"$OUT/te-install.log" 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} MEGATRON_LM_PATH=${MEGATRON_LM_PATH:-$PWD/.mlm}
hep() { bash scripts/hybridep-device.sh exec "$@"; }
case ${1:-} in
  setup)
    python3 -c 'import transformer_engine.pytorch as te; print("TE", te.__file__)' 2>&1 | tail -1
    bash scripts/hybridep-device.sh build || exit $?
    for f in hep-fp8-rings hep-rings; do  # the planner's prediction, written before any run
      DRY_RUN=1 ITERS=12 bash examples/megatron-h200/run.sh "$f" | sed 's/.*bufreuse.integrations.entry //' \
        | tr ' ' '\n' >"$OUT/$f.args"
      python3 -m bufreuse plan "$OUT/$f.args" --data-parallel-size 2 >"$OUT/plan-$f.txt" 2>&1
      python3 -m bufreuse plan --json "$OUT/$f.args" --data-parallel-size 2 >"$OUT/plan-$f.json" 2>&1
    done
    KERNELS_TIMEOUT=${KERNELS_TIMEOUT:-240} bash scripts/hybridep-device.sh kernels ;;
  ab)
    # shellcheck disable=SC2086
    hep env ROUNDS=${ROUNDS:-1} ITERS=${ITERS:-12} WARMUP=${WARMUP:-4} LIMIT=${LIMIT:-150} BUDGET_S=${BUDGET_S:-560} \
      bash scripts/megatron-ab.sh ${HEP_FAMILIES:-hep-fp8 hep-fp8e hep-fp8d} ;;
  tests)
    hep bash scripts/gpu-tests.sh "${@:2}" ;;
  *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
