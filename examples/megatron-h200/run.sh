#!/usr/bin/env bash
# Real Megatron-LM pretraining (pretrain_gpt.py) through the bufreuse entry wrapper on one GPU.
# Usage (repo root, on a CUDA machine with megatron-core importable):
#   MEGATRON_LM_PATH=/path/to/Megatron-LM OUT=out bash examples/megatron-h200/run.sh [RUN...]
# RUN: control rings rings-graph            local spec, no TE (the 2026-12-02 runs), 50 iterations
#      te-control te-rings                  TE spec (TEGroupedMLP, grouped GEMM), bf16, 50 iterations
#      te-fp8-control te-fp8-rings          the same with FP8 (hybrid format, delayed scaling)
#      mem-<run>                            a short (16 iterations) <run> with --record-memory-history
#      ab-<family>                          A B A B: <family>-control, <family>-rings, twice (family:
#                                           local, te, te-fp8), logs <family>-control-1 ... -rings-2
# (no RUN: control rings rings-graph). Writes OUT/<name>.log per run (and OUT/<name>.pickle, the
# allocator snapshot, for mem-* runs only: the timed runs never record memory history).
# TE runs need transformer_engine importable (on the lent H200: scripts/device-te.sh, then
# PYTHONPATH=/tmp/site). scripts/megatron-ab.sh runs an A/B family and compares it.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (pretrain_gpt.py)}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
ITERS=${ITERS:-50}
COMMON=(
  --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --moe-ffn-hidden-size 1024
  --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
  --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 --min-lr 1e-5
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32768
  --no-gradient-accumulation-fusion --bf16 --no-masked-softmax-fusion --disable-bias-linear
  --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm
  --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --expert-model-parallel-size 1
  --log-interval 1 --log-throughput --log-memory-interval 10 --eval-iters 0 --eval-interval 100000 --seed 1234
)
LOCAL=(--transformer-impl local)
TE=(--transformer-impl transformer_engine --moe-grouped-gemm)
FP8=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max)
RINGS=(--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 2
  --moe-hybridep-num-expert-output-buffers 2)
GRAPH=(--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 3 --no-check-for-nan-in-loss-and-grad
  --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity)

run() {  # name iters timeout_s extra args...
  local name=$1 iters=$2 limit=$3
  shift 3
  local args=("${COMMON[@]}" --train-iters "$iters" "$@")
  echo "== $name: torchrun --nproc-per-node 1 -m bufreuse.integrations.entry ${args[*]}" | tee "$out/$name.log"
  timeout "$limit" torchrun --nproc-per-node 1 --master-port 29533 -m bufreuse.integrations.entry \
    "${args[@]}" >>"$out/$name.log" 2>&1
  echo "== $name exit $?" | tee -a "$out/$name.log"
}

spec() {  # run name -> the arguments after COMMON (empty and status 1 for an unknown name)
  case $1 in
    control) echo "${LOCAL[*]}" ;;
    rings) echo "${LOCAL[*]} ${RINGS[*]}" ;;
    rings-graph) echo "${LOCAL[*]} ${RINGS[*]} ${GRAPH[*]}" ;;
    te-control) echo "${TE[*]}" ;;
    te-rings) echo "${TE[*]} ${RINGS[*]}" ;;
    te-fp8-control) echo "${TE[*]} ${FP8[*]}" ;;
    te-fp8-rings) echo "${TE[*]} ${FP8[*]} ${RINGS[*]}" ;;
    *) return 1 ;;
  esac
}

timed() {  # name [log name]: one timed run (no memory history)
  local extra
  extra=$(spec "$1") || { echo "unknown run $1" >&2; return 2; }
  # shellcheck disable=SC2086  # spec's words are flags without spaces
  run "${2:-$1}" "$ITERS" "${LIMIT:-240}" $extra
}

names=("$@")
[ ${#names[@]} -eq 0 ] && names=(control rings rings-graph)
status=0
for name in "${names[@]}"; do
  case $name in
    mem-*)
      base=${name#mem-}
      extra=$(spec "$base") || { echo "unknown run $base" >&2; status=2; continue; }
      # shellcheck disable=SC2086
      run "$name" 16 "${LIMIT:-240}" $extra --record-memory-history --memory-snapshot-path "$out/$name.pickle" ;;
    ab-*)
      family=${name#ab-}
      prefix=$family
      [ "$family" = local ] && prefix=""
      for round in 1 2; do
        for arm in control rings; do
          timed "${prefix:+$prefix-}$arm" "$family-$arm-$round" || status=2
        done
      done ;;
    *) timed "$name" || status=2 ;;
  esac
done
exit $status
