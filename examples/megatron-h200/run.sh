#!/usr/bin/env bash
# Real Megatron-LM pretraining (pretrain_gpt.py) through the bufreuse entry wrapper on one GPU.
# Usage (repo root, on a CUDA machine with megatron-core importable):
#   MEGATRON_LM_PATH=/path/to/Megatron-LM OUT=out bash examples/megatron-h200/run.sh [RUN...]
# RUN: control rings rings-graph            local spec, no TE (the 2026-12-02 runs), tiny shape
#      te-control te-rings                  TE spec (TEGroupedMLP, grouped GEMM), bf16, tiny shape
#      te-fp8-control te-fp8-rings          the same with FP8 (hybrid format, delayed scaling)
#      gb-te-control gb-te-rings            GPU-bound shape (hidden 4096, 16 experts top-4, seq 4096,
#                                           2 layers), TE spec, grouped GEMM, bf16, 4 + 4 ring slots
#      gb-te-pad-control gb-te-pad-rings    the GPU-bound TE shape with fixed shapes (capacity factor 1.0, padded
#                                           to capacity: no per-layer host wait, the same work every iteration),
#                                           rings at the planned depth (2 dispatch, 1 expert slot)
#      gb-te-graph-control gb-te-graph-rings   the fixed-shape family with full-iteration CUDA graphs (the
#                                           seed's mode), rings at the planned depth
#      gb-te-fp8-control gb-te-fp8-rings    the GPU-bound TE shape with FP8 (hybrid, delayed)
#      gb4-te-pad-control gb4-te-pad-rings  the fixed-shape family at micro-batch 4 (16384 tokens per micro-batch,
#                                           global batch 16): GPU-bound in eager mode on the H200's host
#      gb4-te-fp8-pad-control gb4-te-fp8-pad-rings   the same with FP8 (hybrid, delayed)
#      Every family above runs at EP = 1, where install() leaves both rings unused (nothing to replace); the rings
#      arms add --moe-bufreuse-ring-single-rank-expert so the expert ring runs as it does where it is used.
#      ep2-gloo-control ep2-gloo-rings      EP = 2: two processes sharing GPU 0 over gloo (--distributed-backend
#                                           gloo; each rank's LOCAL_RANK set to 0 for megatron's set_device),
#                                           local spec, tiny shape, rings at the planned depth (1 dispatch, 1
#                                           expert slot: `bufreuse plan`); install() leaves both unused at EP 2
#                                           without EP overlap (nothing waits pending-free: docs/megatron.md)
#      ep2-gloo-kept-control ep2-gloo-kept-rings   the same, the rings kept (--moe-bufreuse-keep-unused-rings):
#                                           what they cost there. No distributed optimizer (its reduce-scatter /
#                                           all-gather of the parameter buffers are NCCL's), no CUDA graphs.
#      ep2-gloo-overlap-control ep2-gloo-overlap-rings   EP = 2 over gloo with --overlap-moe-expert-parallel-comm
#                                           (combined 1F1B: dispatch/combine on megatron's comm stream), the one
#                                           all-to-all configuration where a buffer crosses streams, so install()
#                                           uses the dispatch ring there; small shape (EP2_SMALL: 2 layers, 4
#                                           microbatches a rank), local spec, rings at the planned depth. Every run
#                                           of this family records allocator history and writes one snapshot per
#                                           rank, OUT/<name>-snapshots/rank<R>.pickle (scripts/rank_snapshots.py,
#                                           which also logs each rank's max allocated / reserved: Megatron's memory
#                                           lines are data-parallel rank 0's); scripts/megatron-ab.sh reports them
#                                           (snapshot-report per arm, --json, the pending-free line).
#      hep-control hep-rings                the seed's configuration on one GPU: EP = 2 as two processes sharing
#      hep-fp8-control hep-fp8-rings        it over gloo, real DeepEP HybridEP kernels (flex dispatcher, hybridep
#      hep-fp8e-* hep-fp8d-*                backend, DeepEP built with bufreuse's output_token edit:
#                                           scripts/hybridep-device.sh), EP overlap (combined 1F1B), TE grouped
#                                           GEMMs (unfused TEGroupedMLP on Hopper), pad-to-capacity, HEP shape;
#                                           bf16 (hep-rings: the expert ring alone, since bf16 GEMMs save the
#                                           dispatch slot) and FP8 (hep-fp8-rings both rings, hep-fp8e-rings the
#                                           expert ring alone, hep-fp8d-rings the dispatch ring alone; their
#                                           controls are the same run, one per family). Each rank writes
#                                           its allocator snapshot (as ep2-gloo-overlap). The kernels need
#                                           LD_PRELOAD=<libstdc++.so.6> (HybridEPBuffer segfaults in get_comm_id
#                                           without it: libstdc++ load order) and USE_MNNVL=0 (no fabric memory
#                                           on one shared GPU: cudaMalloc + CUDA IPC); this script sets both.
#      mem-<run>                            a short (16 iterations) <run> with --record-memory-history
#      prof-<run>                           a short <run> (PROF_ITERS, default 14) under the torch profiler for
#                                           iterations PROF_START..PROF_END-1 (default 10, 11): OUT/prof-<run>/
#                                           torch_profile/rank-0.json.gz (summarise: scripts/trace_summary.py);
#                                           prof-<run>@<log> writes OUT/<log>.log and OUT/<log>/
#      ab-<family>                          A B A B: <family>-control, <family>-rings, twice (family:
#                                           local, te, te-fp8, gb-te, ...), logs <family>-control-1 ...
#      <run>@<log>                          <run>, logged as OUT/<log>.log (scripts/megatron-ab.sh uses it)
# (no RUN: control rings rings-graph). ITERS iterations per timed run (default 50), LIMIT seconds per
# run (default 240; a run past it is killed). Writes OUT/<name>.log per run (and OUT/<name>.pickle,
# the allocator snapshot, for mem-* runs only: the timed runs never record memory history).
# TE runs need transformer_engine importable (on the lent H200: scripts/device-te.sh, then
# PYTHONPATH=/tmp/site). scripts/megatron-ab.sh runs interleaved A/B rounds and compares them.
# DRY_RUN=1 prints each run's command line instead of running it. LAUNCHER=python runs the entry without
# torchrun (one process, RANK/WORLD_SIZE/MASTER_* set by hand); the default is torchrun.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
[ "${DRY_RUN:-0}" = 1 ] && : "${MEGATRON_LM_PATH:=.mlm}"
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (pretrain_gpt.py)}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
ITERS=${ITERS:-50}
TINY=(  # host-bound: 10-17 TFLOP/s on an H200 with TE
  --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --moe-ffn-hidden-size 1024
  --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
  --micro-batch-size 2 --global-batch-size 8 --num-experts 8 --moe-router-topk 2
)
GB4=(  # the GB shape at micro-batch 4: four times the GPU work per host launch (eager is GPU-bound)
  --num-layers 2 --hidden-size 4096 --ffn-hidden-size 4096 --moe-ffn-hidden-size 2048
  --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096
  --micro-batch-size 4 --global-batch-size 16 --num-experts 16 --moe-router-topk 4
)
GB=(  # GPU-bound, shaped like MoE training: 16 experts top-4, 4 micro-batches of 4096 tokens
  --num-layers 2 --hidden-size 4096 --ffn-hidden-size 4096 --moe-ffn-hidden-size 2048
  --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096
  --micro-batch-size 1 --global-batch-size 4 --num-experts 16 --moe-router-topk 4
)
COMMON=(
  --lr 1e-4 --min-lr 1e-5 --mock-data --tokenizer-type NullTokenizer --vocab-size 32768
  --no-gradient-accumulation-fusion --bf16 --no-masked-softmax-fusion --disable-bias-linear
  --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm
  --moe-token-dispatcher-type alltoall --expert-model-parallel-size 1
  --log-interval 1 --log-throughput --log-memory-interval 10 --eval-iters 0 --eval-interval 100000 --seed 1234
)
LOCAL=(--transformer-impl local)
TE=(--transformer-impl transformer_engine --moe-grouped-gemm)
FP8=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max)
# At EP = 1 both rings replace nothing and install() leaves them alone; EXERCISE rings the expert FC2 output
# anyway (no copy: TE writes into the slot), so the rings arms measure the expert ring's hooks.
EXERCISE=(--moe-bufreuse-ring-single-rank-expert)
RINGS=(--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 2
  --moe-hybridep-num-expert-output-buffers 2 "${EXERCISE[@]}")
# gb-te / gb-te-fp8 rings: 4 slots each, as the seed ran them (`bufreuse plan` on the dropless gb-te arguments
# asks for 1 and 1). At EP = 1 the all-to-all dispatch is an identity and bufreuse leaves it alone (install()
# notes the dispatch ring unused): only the expert FC2 ring is active in these runs.
GB_RINGS=(--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 4
  --moe-hybridep-num-expert-output-buffers 4 "${EXERCISE[@]}")
PAD=(--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity)
EP2_GLOO=(--distributed-backend gloo --expert-model-parallel-size 2)  # after COMMON's EP 1: the last one counts
EP2_RINGS=(--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 1
  --moe-hybridep-num-expert-output-buffers 1)  # `bufreuse plan`: PP 1, DP 2, 2 microbatches -> 1 and 1
EP2_SMALL=(  # EP overlap: 2 layers, 1024 tokens a micro-batch, global 8 / (micro 1 x DP 2) = 4 microbatches a rank
  --num-layers 2 --hidden-size 1024 --ffn-hidden-size 4096 --moe-ffn-hidden-size 1024
  --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
  --micro-batch-size 1 --global-batch-size 8 --num-experts 8 --moe-router-topk 2
)
# ep2-gloo-overlap: megatron-core 0.19.2's asserts on the path overlap_moe_expert_parallel_comm takes, and how
# this family meets each (tests/test_megatron_ep2_gloo.py runs parse_args + validate_args + TransformerConfig):
#   transformer_config.py:2671-2673  torch >= 2.6 (the venv's and the device's torch)
#   transformer_config.py:2674-2678  PP > 1 needs VPP: PP = 1 here (no pipeline, no VPP)
#   transformer_config.py:2680-2682  expert_model_parallel_size > 1: EP = 2
#   transformer_config.py:2683-2686  alltoall or flex dispatcher: --moe-token-dispatcher-type alltoall (COMMON)
#   transformer_config.py:2688-2699  no full recompute, no recompute method / num layers, "moe" not in
#                                    recompute_modules: no recompute flag at all (recompute_modules defaults to
#                                    ["core_attn"], transformer_config.py:1763-1764, used only with selective)
#   transformer_config.py:2701-2704  bf16 or fp16: --bf16 (COMMON)
#   transformer_config.py:2706-2708  no moe_shared_expert_overlap: no shared experts here
#   transformer_config.py:2709-2713  mtp_num_layers None/0/1: no MTP
#   transformer_config.py:2717-2736  ncclep gates: not the flex dispatcher
#   transformer_config.py:2738-2747  CUDA-graph scope: no CUDA graphs (--cuda-graph-impl none, the default)
#   transformer_config.py:2749-2752  delay_wgrad_compute needs overlap: not set (optional; without it
#                                    TransformerLayerNode.backward_dw returns at once, models/common/utils.py:325)
#   transformer_config.py:2759-2776  overlap_dispatch_backward_with_experts_wgrad / ep_overlap_early_attn_memory_
#                                    release: neither set
#   transformer_layer.py:1263        CUDA graph of the whole MLP/MoE: no CUDA graphs
#   arguments.py:1413-1439           TP / CP > 1 with overlap only warns (CUDA_DEVICE_MAX_CONNECTIONS): TP = CP = 1;
#                                    megatron advises more than 1 connection for EP overlap, so this family's ranks
#                                    run with CUDA_DEVICE_MAX_CONNECTIONS=32 (the others keep 1)
#   schedules.py:751 forward_backward_no_pipelining -> combined_1f1b.py:combined_1f1b_schedule_for_no_pipelining
#                                    (PP = 1): forward_step_func(..., return_schedule_plan=True): .mlm/pretrain_gpt.py
#                                    forward_step asserts args.overlap_moe_expert_parallel_comm (pretrain_gpt.py:340)
#   combined_1f1b.py:343-345         checkpoint_activations_microbatch None: PP = 1 passes None
#   combined_1f1b.py:387-389         the forward step returns an AbstractSchedulePlan: GPTModel.build_schedule_plan
#   model_chunk_schedule_plan.py:534, 600   b_grad / b_layer set: the schedule's own invariants (>= 1 microbatch)
#   pipeline_parallel/utils.py:73,84 vp_stage None without VPP
#   models/common/utils.py:391-396   _BackwardDWWrapper needs a TransformerLayer and GraphableMegatronModule:
#                                    GPT's decoder layers are both
#   TE is not needed: models/gpt/fine_grained_callables.py calls MoELayer.route / preprocess / dispatch /
#   routed_experts_compute / combine and TransformerLayer._forward_attention, all spec-independent; the
#   backward_dw callables run only with delay_wgrad_compute. So the local spec (SequentialMLP), as the other EP 2
#   families. Micro-batch: any; microbatches: the combined schedule runs F0, (F(i+1) B(i)) x (m-1), B(m-1), so
#   m >= 2 gives the overlapped steps; m = 4 here. Mock data (COMMON).
# gloo (--distributed-backend gloo): megatron's all_to_all (tensor_parallel/mappings.py:_AllToAll.forward) is
# synchronous (no async_op unless use_nccl_stream); the schedule puts it on the comm stream with
# torch.cuda.stream(comm) (pipeline_parallel/utils.py:ScheduleNode.stream_acquire_context). Gloo on CUDA tensors
# stages through pinned host memory on a pool stream of its own (ProcessGroupGloo.cpp AsyncAlltoallCUDAWork: the
# side stream waits for the current (comm) stream, D2H copy, host all-to-all, H2D copy; wait() makes the comm
# stream wait for the side stream and the host for the host part). So every dispatch/combine blocks the host
# for a host-side all-to-all: step times here are not NCCL's, the memory per rank is what the rings change.
EP2_OVERLAP=(--overlap-moe-expert-parallel-comm)
# hep-*: the shape the seed's queue was first measured at on one GPU (docs/megatron.md): 2 layers, hidden 4096,
# 16 experts top-4 (8 local), sequence 4096, global 8 / (micro 1 x DP 2) = 4 microbatches a rank.
HEP=(
  --num-layers 2 --hidden-size 4096 --ffn-hidden-size 4096 --moe-ffn-hidden-size 2048
  --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096
  --micro-batch-size 1 --global-batch-size 8 --num-experts 16 --moe-router-topk 4
)
HEP_PATH=(--distributed-backend gloo --expert-model-parallel-size 2 --moe-token-dispatcher-type flex
  --moe-flex-dispatcher-backend hybridep --moe-flex-dispatcher-num-sms 16 --moe-router-dtype fp32
  --overlap-moe-expert-parallel-comm --swiglu "${TE[@]}" "${PAD[@]}")
# Ring depths: `bufreuse plan` on the hep-fp8-rings arguments (docs/benchmarks.md, "HybridEP at EP = 2").
HEP_EXPERT=(--moe-hybridep-num-expert-output-buffers "${HEP_EXPERT_SLOTS:-1}")
HEP_DISPATCH=(--moe-hybridep-reuse-dispatch-output-buffers
  --moe-hybridep-num-dispatch-output-buffers "${HEP_DISPATCH_SLOTS:-1}" --moe-hybridep-num-expert-output-buffers 0)
# `bufreuse plan` on the ep2-gloo-overlap-rings arguments (--data-parallel-size 2): schedule combined, m = 4,
# dispatch_output minimum 1 (released after forward: the mlp node frees its input, 4 local experts; the plan's
# model has the control holding 4 x 8 MiB pending-free), expert_fc2_output minimum 1 but "not used" (with 4 local experts the combine
# reads the sort's copy). install() uses the dispatch ring and leaves the expert ring unused.
EP2_OVERLAP_RINGS=(--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 1
  --moe-hybridep-num-expert-output-buffers 1)
GRAPH=(--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 3 --no-check-for-nan-in-loss-and-grad "${PAD[@]}")
# The planned depth: `bufreuse plan` on the gb-te-pad / gb-te-graph arguments (--data-parallel-size 1) says
# dispatch minimum 2 (released after backward: bf16 GEMMs save it), expert minimum 1 (released after forward).
# At EP = 1 the dispatch ring is not registered (identity dispatch); its knob is the plan's anyway.
PLANNED_RINGS=(--moe-hybridep-reuse-dispatch-output-buffers --moe-hybridep-num-dispatch-output-buffers 2
  --moe-hybridep-num-expert-output-buffers 1 "${EXERCISE[@]}")

run() {  # name iters timeout_s shape extra args...: shape is TINY or GB
  local name=$1 iters=$2 limit=$3 shape=$4
  shift 4
  local -n shape_args=$shape
  local args=("${shape_args[@]}" "${COMMON[@]}" --train-iters "$iters" "$@")
  local rc launch=(torchrun --nproc-per-node 1 --master-port 29533)
  # ep2-gloo-*: two ranks on the one GPU; megatron calls torch.cuda.set_device(LOCAL_RANK), so each sees 0
  [[ ${RUN_BASE:-$name} == *ep2-gloo-* ]] && launch=(torchrun --nproc-per-node 2 --master-port 29533 --no-python
    env LOCAL_RANK=0 python3)
  # ep2-gloo-overlap-*: more than one hardware queue (megatron's advice for EP overlap, arguments.py:1426-1435),
  # and every rank's allocator history, dumped per rank (Megatron's own dump is the last rank's only)
  local snapshots=""
  if [[ ${RUN_BASE:-$name} == *ep2-gloo-overlap-* || ${RUN_BASE:-$name} == hep-* ]]; then
    snapshots=$out/$name-snapshots
    launch=(torchrun --nproc-per-node 2 --master-port 29533 --no-python env LOCAL_RANK=0
      CUDA_DEVICE_MAX_CONNECTIONS=32 python3 "$repo/scripts/rank_snapshots.py" --out "$snapshots")
  fi
  # hep-*: what DeepEP's HybridEP kernels need on one shared GPU (see the header)
  local lib=${HEP_LIBSTDCXX:-/usr/lib/x86_64-linux-gnu/libstdc++.so.6}
  [[ ${RUN_BASE:-$name} == hep-* ]] && launch=(env USE_MNNVL=0
    "LD_PRELOAD=$([[ ${LD_PRELOAD:-} == *"$lib"* ]] && echo "$LD_PRELOAD" || echo "$lib${LD_PRELOAD:+:$LD_PRELOAD}")"
    "${launch[@]}")
  # LAUNCHER=python: one process, torchrun's environment set by hand (saves torchrun's own start-up)
  [ "${LAUNCHER:-torchrun}" = python ] && launch=(env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 python3)
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "== $name (timeout ${limit}s): ${launch[*]} -m bufreuse.integrations.entry ${args[*]}"
    return 0
  fi
  [ -n "$snapshots" ] && rm -rf "$snapshots"  # no earlier call's snapshot may stand in for this run's
  echo "== $name: ${launch[*]} -m bufreuse.integrations.entry ${args[*]}" | tee "$out/$name.log"
  timeout -k 15 "$limit" "${launch[@]}" -m bufreuse.integrations.entry "${args[@]}" >>"$out/$name.log" 2>&1
  rc=$?
  echo "== $name exit $rc" | tee -a "$out/$name.log"
  return $rc
}

shape() {  # run name -> the name of its shape array
  case $1 in
    ep2-gloo-overlap-*) echo EP2_SMALL ;;
    hep-*) echo HEP ;;
    gb4-*) echo GB4 ;;
    gb-*) echo GB ;;
    *) echo TINY ;;
  esac
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
    gb-te-control) echo "${TE[*]}" ;;
    gb-te-rings) echo "${TE[*]} ${GB_RINGS[*]}" ;;
    gb-te-graph-control) echo "${TE[*]} ${GRAPH[*]}" ;;
    gb-te-graph-rings) echo "${TE[*]} ${PLANNED_RINGS[*]} ${GRAPH[*]}" ;;
    gb-te-pad-control) echo "${TE[*]} ${PAD[*]}" ;;
    gb-te-pad-rings) echo "${TE[*]} ${PAD[*]} ${PLANNED_RINGS[*]}" ;;
    gb-te-fp8-control) echo "${TE[*]} ${FP8[*]}" ;;
    gb-te-fp8-rings) echo "${TE[*]} ${FP8[*]} ${GB_RINGS[*]}" ;;
    gb4-te-pad-control) echo "${TE[*]} ${PAD[*]}" ;;
    gb4-te-pad-rings) echo "${TE[*]} ${PAD[*]} ${PLANNED_RINGS[*]}" ;;
    gb4-te-fp8-pad-control) echo "${TE[*]} ${FP8[*]} ${PAD[*]}" ;;
    gb4-te-fp8-pad-rings) echo "${TE[*]} ${FP8[*]} ${PAD[*]} ${PLANNED_RINGS[*]}" ;;
    ep2-gloo-control | ep2-gloo-kept-control) echo "${LOCAL[*]} ${EP2_GLOO[*]}" ;;
    ep2-gloo-rings) echo "${LOCAL[*]} ${EP2_GLOO[*]} ${EP2_RINGS[*]}" ;;
    ep2-gloo-overlap-control) echo "${LOCAL[*]} ${EP2_GLOO[*]} ${EP2_OVERLAP[*]}" ;;
    ep2-gloo-overlap-rings) echo "${LOCAL[*]} ${EP2_GLOO[*]} ${EP2_OVERLAP[*]} ${EP2_OVERLAP_RINGS[*]}" ;;
    ep2-gloo-kept-rings) echo "${LOCAL[*]} ${EP2_GLOO[*]} ${EP2_RINGS[*]} --moe-bufreuse-keep-unused-rings" ;;
    hep-control) echo "${HEP_PATH[*]}" ;;
    hep-rings) echo "${HEP_PATH[*]} ${HEP_EXPERT[*]}" ;;
    hep-fp8-control | hep-fp8e-control | hep-fp8d-control) echo "${HEP_PATH[*]} ${FP8[*]}" ;;
    hep-fp8-rings) echo "${HEP_PATH[*]} ${FP8[*]} ${HEP_DISPATCH[*]:0:3} ${HEP_EXPERT[*]}" ;;
    hep-fp8e-rings) echo "${HEP_PATH[*]} ${FP8[*]} ${HEP_EXPERT[*]}" ;;
    hep-fp8d-rings) echo "${HEP_PATH[*]} ${FP8[*]} ${HEP_DISPATCH[*]}" ;;
    *) return 1 ;;
  esac
}

timed() {  # name [log name]: one timed run (no memory history)
  local extra
  extra=$(spec "$1") || { echo "unknown run $1" >&2; return 2; }
  RUN_BASE=$1  # run() picks the launcher by the run, whatever the log is called
  # shellcheck disable=SC2086  # spec's words are flags without spaces
  run "${2:-$1}" "$ITERS" "${LIMIT:-240}" "$(shape "$1")" $extra
}

names=("$@")
[ ${#names[@]} -eq 0 ] && names=(control rings rings-graph)
status=0
for name in "${names[@]}"; do
  case $name in
    mem-*)
      base=${name#mem-}
      extra=$(spec "$base") || { echo "unknown run $base" >&2; status=2; continue; }
      RUN_BASE=$base
      # shellcheck disable=SC2086
      run "$name" 16 "${LIMIT:-240}" "$(shape "$base")" $extra --record-memory-history --memory-snapshot-path "$out/$name.pickle" ;;
    prof-*)
      # torch profiler over iterations PROF_START..PROF_END-1 of a PROF_ITERS run (Megatron's --profile
      # --use-pytorch-profiler); the Chrome trace lands in OUT/<name>/torch_profile/rank-0.json.gz, which
      # scripts/trace_summary.py reads
      base=${name#prof-} log=$name
      if [[ $base == *@* ]]; then log=${base#*@}; base=${base%%@*}; fi  # prof-<run>@<log>: logged as <log>
      extra=$(spec "$base") || { echo "unknown run $base" >&2; status=2; continue; }
      RUN_BASE=$base
      # shellcheck disable=SC2086
      run "$log" "${PROF_ITERS:-14}" "${LIMIT:-240}" "$(shape "$base")" $extra --profile --use-pytorch-profiler \
        --profile-step-start "${PROF_START:-10}" --profile-step-end "${PROF_END:-12}" --profile-ranks 0 \
        --tensorboard-dir "$out/$log/tb" || status=2 ;;
    ab-*)
      family=${name#ab-}
      prefix=$family
      [ "$family" = local ] && prefix=""
      for round in 1 2; do
        for arm in control rings; do
          timed "${prefix:+$prefix-}$arm" "$family-$arm-$round" || status=2
        done
      done ;;
    *@*) timed "${name%%@*}" "${name#*@}" || status=2 ;;
    *) timed "$name" || status=2 ;;
  esac
done
exit $status
