#!/usr/bin/env bash
# Real Megatron-LM pretraining (pretrain_gpt.py) through the bufreuse entry wrapper on one GPU.
# Usage (repo root, on a CUDA machine with megatron-core importable):
#   MEGATRON_LM_PATH=/path/to/Megatron-LM OUT=out bash examples/megatron-h200/run.sh [control rings rings-graph]
# Writes OUT/<name>.log and OUT/<name>.pickle (the memory snapshot) per run.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (pretrain_gpt.py)}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
COMMON=(
  --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --moe-ffn-hidden-size 1024
  --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
  --micro-batch-size 2 --global-batch-size 8 --train-iters 16 --lr 1e-4 --min-lr 1e-5
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32768
  --transformer-impl local --no-gradient-accumulation-fusion --bf16 --no-masked-softmax-fusion --disable-bias-linear
  --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm
  --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --expert-model-parallel-size 1
  --log-interval 2 --log-throughput --eval-iters 0 --eval-interval 100000 --seed 1234
  --record-memory-history
)
RINGS=(--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 2
  --moe-hybridep-num-expert-output-buffers 2)
GRAPH=(--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 3 --no-check-for-nan-in-loss-and-grad
  --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity)

run() {  # name timeout_s extra args...
  local name=$1 limit=$2
  shift 2
  echo "== $name: torchrun --nproc-per-node 1 -m bufreuse.integrations.entry ${COMMON[*]} $*" | tee "$out/$name.log"
  timeout "$limit" torchrun --nproc-per-node 1 --master-port 29533 -m bufreuse.integrations.entry \
    "${COMMON[@]}" --memory-snapshot-path "$out/$name.pickle" "$@" >>"$out/$name.log" 2>&1
  echo "== $name exit $?" | tee -a "$out/$name.log"
}

names=("$@")
[ ${#names[@]} -eq 0 ] && names=(control rings rings-graph)
for name in "${names[@]}"; do
  case $name in
    control) run control "${LIMIT:-60}" ;;
    rings) run rings "${LIMIT:-60}" "${RINGS[@]}" ;;
    rings-graph) run rings-graph "${LIMIT:-70}" "${RINGS[@]}" "${GRAPH[@]}" ;;
    *) echo "unknown run $name" >&2 ;;
  esac
done
