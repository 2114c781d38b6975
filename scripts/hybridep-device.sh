#!/usr/bin/env bash
# Real DeepEP HybridEP kernels on the lent H200, one rank, checked against tests/fakes/deep_ep_hybrid.py.
#
#   bash scripts/hybridep-device.sh prepare   # here (CPU, needs PyPI): stage .deepep/ (git-ignored, a few MiB):
#                                             # DeepEP hybrid-ep source at the pinned commit (git archive of the
#                                             # mirror fetched with the `fetch` tool) + the megatron-core cp312 wheel
#   bash scripts/hybridep-device.sh run       # on the device, carry [".deepep"]: build (timeout BUILD_TIMEOUT s)
#                                             # into /tmp/site-deepep, then tests/test_hybridep_real_gpu.py
#                                             # (what is left of TOTAL_TIMEOUT=570 s); logs under $OUT
#   bash scripts/hybridep-device.sh build     # on the device: the build step alone
#   bash scripts/hybridep-device.sh kernels   # on the device, after build: the real-kernel tests alone
#                                             # (world sizes 1 and 2, output_token; tests/test_hybridep_*_gpu.py)
#   bash scripts/hybridep-device.sh exec CMD  # on the device, after build: CMD with the kernels' environment
#                                             # (CUDA_HOME and the JIT cache, LD_PRELOAD, USE_MNNVL=0, DeepEP on PYTHONPATH)
#   bash scripts/hybridep-device.sh probe     # on the device, after build: scripts/hybridep_probe.py (which
#                                             # variant of the buffer's constructor builds; where the others stop)
#
# Only the `hybrid_ep_cpp` extension is built (HybridEP needs no NVSHMEM; the classic `deep_ep_cpp` Buffer is
# not built), for sm_90 only; the installed `deep_ep/__init__.py` is therefore ours: it imports HybridEPBuffer
# only. Outputs in $OUT: hybridep-build.log, hybridep-test.log, hybridep-facts.json, hybridep-status.txt (one
# line: what stopped the run, or "ok"). Exit code: 0 when the test passed, else non-zero.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
COMMIT=94a9f8f6b146c07d97ec58f67cd6d303296d6098   # DeepEP branch hybrid-ep, 2026-07-10
MIRROR=${DEEPEP_MIRROR:-/work/.mirror/deepseek-ai+DeepEP/repo}
STAGE=$REPO/.deepep
SITE=/tmp/site-deepep
OUT=${OUT:-$REPO/out}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-240}
TOTAL_TIMEOUT=${TOTAL_TIMEOUT:-570}   # build + test together stay under the device's 600 s per call

status() { mkdir -p "$OUT"; printf '%s\n' "$*" | tee "$OUT/hybridep-status.txt"; }

prepare() {
  set -e
  git --git-dir="$MIRROR" cat-file -e "$COMMIT^{commit}" 2>/dev/null || {
    echo "hybridep: commit $COMMIT not in $MIRROR (fetch github:deepseek-ai/DeepEP first)" >&2; exit 2; }
  rm -rf "$STAGE" && mkdir -p "$STAGE/src" "$STAGE/whl"
  # What setup.py's get_extension_hybrid_ep_cpp() compiles and copies, and the Python package; no tests, docs,
  # figures, classic kernels or third-party (NCCL/DOCA are for multi-node builds only).
  git --git-dir="$MIRROR" archive --format=tar "$COMMIT" setup.py LICENSE deep_ep csrc/hybrid_ep \
    | tar -x -C "$STAGE/src"
  echo "$COMMIT" > "$STAGE/COMMIT"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 -d "$STAGE/whl" "megatron-core==${MEGATRON_CORE_VERSION:-0.19.2}"
  grep -qx '/.deepep/' .gitignore || echo '/.deepep/' >> .gitignore
  du -sh "$STAGE"
  local kib; kib=$(du -sk "$STAGE" | cut -f1)
  [ "$kib" -lt 32768 ] || { echo "hybridep: .deepep is ${kib} KiB, over the 32 MiB this script allows" >&2; exit 3; }
}

# A CUDA toolkit (bin/nvcc and include/cuda_runtime.h): HybridEP's run-time JIT calls $CUDA_HOME/bin/nvcc with
# -I$CUDA_HOME/include itself, so a bare nvcc wrapper's parent (e.g. /usr/local) will not do.
find_cuda() {
  local c nv
  nv=$(command -v nvcc 2>/dev/null || true)
  for c in "${CUDA_HOME:-}" \
    "$(python3 -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")' 2>/dev/null)" \
    "${nv:+$(dirname "$(dirname "$(readlink -f "$nv")")")}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$c" ] && [ -x "$c/bin/nvcc" ] && [ -f "$c/include/cuda_runtime.h" ]; then echo "$c"; return 0; fi
  done
  return 1
}

# setup.py links -lcuda and -lnvtx3interop; make an unversioned name the linker finds (driver stubs, or a .so.1
# from the toolkit or the pip nvidia packages) and remember where the runtime copy is.
link_shims() {
  local shim=/tmp/deepep-libs name d f
  mkdir -p "$shim"
  local dirs=("$CUDA_HOME/lib64" "$CUDA_HOME/targets/x86_64-linux/lib" "$CUDA_HOME/lib64/stubs"
    "$CUDA_HOME/targets/x86_64-linux/lib/stubs" /usr/lib/x86_64-linux-gnu /usr/lib64)
  while IFS= read -r d; do dirs+=("$d"); done < <(python3 - <<'EOF' 2>/dev/null
import glob, os, site
for p in site.getsitepackages():
    for d in sorted(glob.glob(os.path.join(p, "nvidia", "**", "lib"), recursive=True)):
        print(d)
EOF
)
  for name in cuda nvtx3interop; do
    f=""
    for d in "${dirs[@]}"; do [ -e "$d/lib$name.so" ] && { f="$d/lib$name.so"; break; }; done
    if [ -z "$f" ]; then
      for d in "${dirs[@]}"; do
        f=$(ls "$d"/lib"$name".so.* 2>/dev/null | head -1)
        [ -n "$f" ] && break
      done
      [ -n "$f" ] && ln -sf "$f" "$shim/lib$name.so"
    fi
    echo "hybridep: lib$name -> ${f:-NOT FOUND}"
    if [ -n "$f" ] && [ "$name" != cuda ]; then
      export LD_LIBRARY_PATH=$(dirname "$f")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
  done
  export LIBRARY_PATH=$shim:$CUDA_HOME/lib64:$CUDA_HOME/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
}

device_env() {
  CUDA_HOME=$(find_cuda) || { status "stopped: no CUDA toolkit with bin/nvcc and include/cuda_runtime.h (CUDA_HOME, torch, PATH, /usr/local/cuda*)"; exit 10; }
  export CUDA_HOME PATH=$CUDA_HOME/bin:$PATH
  export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} HYBRID_EP_MULTINODE=0 USE_NIXL=0
  export HYBRID_EP_CACHE_DIR=/tmp/deepep-jit NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  export PYTHONUNBUFFERED=1
  unset NVSHMEM_DIR
  link_shims
}

# What the built kernels need at run time on one GPU shared by several processes:
# - libstdc++ preloaded: without it HybridEPBuffer(...) segfaults in get_comm_id (the extension carries parts of
#   libstdc++; which copy's locale state a stream insert meets depends on load order);
# - USE_MNNVL=0: no fabric memory on one shared GPU; HybridEP then uses cudaMalloc + CUDA IPC.
kernel_env() {
  local lib=${HEP_LIBSTDCXX:-/usr/lib/x86_64-linux-gnu/libstdc++.so.6}
  [[ ${LD_PRELOAD:-} == *"$lib"* ]] || export LD_PRELOAD=$lib${LD_PRELOAD:+:$LD_PRELOAD}
  export USE_MNNVL=0
}

build() {
  mkdir -p "$OUT"
  local log=$OUT/hybridep-build.log
  (
    echo "== $(date -u +%FT%TZ) DeepEP hybrid-ep @ $(cat "$STAGE/COMMIT" 2>/dev/null || echo '?')"
    [ -f "$STAGE/src/setup.py" ] || { echo "no $STAGE/src/setup.py: run 'prepare' here and carry .deepep"; exit 11; }
    device_env
    echo "CUDA_HOME=$CUDA_HOME"; nvcc --version | tail -2
    echo "JIT links: $(ls "$CUDA_HOME"/lib64/libcudart.so* 2>/dev/null | tr '\n' ' ')"
    python3 -c 'import torch.utils.cpp_extension as c; print("ninja available:", c.is_ninja_available())'
    python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")'
    local tag; tag=$COMMIT-$(md5sum "$REPO/scripts/deepep_output_token.py" | cut -c1-8)
    if [ -f "$SITE/.built-$tag" ] && ls "$SITE"/hybrid_ep_cpp*.so >/dev/null 2>&1; then
      echo "already built in $SITE"; exit 0
    fi
    rm -rf "$SITE" /tmp/deepep-src /tmp/deepep-build && mkdir -p "$SITE"
    cp -r "$STAGE/src" /tmp/deepep-src && cd /tmp/deepep-src
    # bufreuse's own edit: dispatch_with_permute(output_token=) (upstream has no caller-provided output)
    python3 "$REPO/scripts/deepep_output_token.py" . || exit 12
    local t0=$SECONDS
    # Upstream's own extension definition (setup.py is import-safe: its setup() call is under __main__).
    timeout -k 10 "$BUILD_TIMEOUT" python3 - "$SITE" <<'EOF'
import sys
import setuptools
from torch.utils.cpp_extension import BuildExtension
site = sys.argv[1]
sys.path.insert(0, ".")
import setup as upstream  # noqa: E402
sys.argv = ["setup.py", "build_ext", "--build-lib", site, "--build-temp", "/tmp/deepep-build"]
setuptools.setup(name="deep_ep", ext_modules=[upstream.get_extension_hybrid_ep_cpp()],
                 cmdclass={"build_ext": BuildExtension})
EOF
    local rc=$?
    echo "build exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || exit "$rc"
    mkdir -p "$SITE/deep_ep"
    cp deep_ep/hybrid_ep_buffer.py "$SITE/deep_ep/"
    cp -r deep_ep/backend "$SITE/deep_ep/backend"   # JIT headers (setup.py copied them from csrc/hybrid_ep)
    cat > "$SITE/deep_ep/__init__.py" <<'EOF'
# Written by bufreuse scripts/hybridep-device.sh: only HybridEP (hybrid_ep_cpp) is built; upstream's __init__
# also imports the classic Buffer from deep_ep_cpp, which this build leaves out.
from .hybrid_ep_buffer import HybridEPBuffer
from hybrid_ep_cpp import HybridEpConfigInstance

__all__ = ["HybridEPBuffer", "HybridEpConfigInstance"]
EOF
    touch "$SITE/.built-$tag"
    ls -la "$SITE" "$SITE/deep_ep"
  ) >"$log" 2>&1
  local rc=$?
  if [ "$rc" != 0 ]; then
    local why="build failed (exit $rc"; [ "$rc" = 124 ] && why="build timed out (over ${BUILD_TIMEOUT} s"
    status "stopped: $why); last lines of $log:"
    grep -n -i -E 'error|fatal|undefined|cannot find' "$log" | tail -25 | tee -a "$OUT/hybridep-status.txt"
    tail -40 "$log" | tee -a "$OUT/hybridep-status.txt"
    exit "$rc"
  fi
  tail -3 "$log"
}

test_env() {  # the staged megatron-core wheel, this checkout and DeepEP on PYTHONPATH; a missing DeepEP fails tests
  mkdir -p /tmp/site-deepep-mc
  if compgen -G "$STAGE/whl/*.whl" >/dev/null && [ ! -d /tmp/site-deepep-mc/megatron ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-deepep-mc \
      "$STAGE"/whl/*.whl >>"$OUT/hybridep-build.log" 2>&1 || echo "hybridep: megatron-core wheel did not install"
  fi
  export PYTHONPATH=$REPO:$SITE:/tmp/site-deepep-mc${PYTHONPATH:+:$PYTHONPATH}
  export BUFREUSE_REQUIRE_DEEPEP=1 OUT
}

kernels() {  # the real-kernel tests (world sizes 1 and 2, with the output_token edit); logs under $OUT
  device_env >/dev/null
  kernel_env
  test_env
  timeout -k 10 "${KERNELS_TIMEOUT:-300}" python3 -m pytest tests/test_hybridep_output_token_gpu.py \
    tests/test_hybridep_real_gpu.py -m gpu -v -p no:cacheprovider -o addopts="-ra --strict-markers" \
    >"$OUT/hybridep-kernels.log" 2>&1
  local rc=$?
  tail -25 "$OUT/hybridep-kernels.log"
  return $rc
}

probe() {
  device_env >/dev/null
  kernel_env
  export PYTHONPATH=$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}
  python3 "$REPO/scripts/hybridep_probe.py" --out "$OUT" 2>&1 | tee "$OUT/hybridep-probe.txt"
}

run() {
  local t_start=$SECONDS
  build || exit $?
  probe
  if [ ! -f "$OUT/hybridep-probe.env" ]; then
    status "stopped: no variant of HybridEPBuffer(...) could be built at world size 1; see $OUT/hybridep-probe.txt"
    exit 15
  fi
  set -a; source "$OUT/hybridep-probe.env"; set +a
  device_env >/dev/null
  kernel_env
  test_env
  # The test gets what the build left; it skips cases that no longer fit (each new kernel variant is one nvcc JIT
  # compile) before the hard limit.
  local RUN_TIMEOUT=$(( TOTAL_TIMEOUT - (SECONDS - t_start) ))
  [ "$RUN_TIMEOUT" -ge 60 ] || { status "stopped: the build left ${RUN_TIMEOUT} s of ${TOTAL_TIMEOUT} s for the test"; exit 13; }
  export HYBRIDEP_DEADLINE=$(( $(date +%s) + RUN_TIMEOUT - 25 ))
  local log=$OUT/hybridep-test.log
  timeout -k 10 "$RUN_TIMEOUT" python3 -m pytest tests/test_hybridep_real_gpu.py -m gpu -v -s -p no:cacheprovider \
    -o addopts="-ra --strict-markers" >"$log" 2>&1
  local rc=$?
  tail -30 "$log"
  local summary; summary=$(grep -E '^=+ .* in [0-9.]+s' "$log" | tail -1 | tr -d '=')
  if [ "$rc" = 0 ] && ! grep -qE '[0-9]+ passed' <<<"$summary"; then
    rc=14; status "stopped: nothing passed ($summary); see $log"
  elif [ "$rc" = 0 ]; then
    status "ok:$summary; build + test $((SECONDS - t_start)) s (facts: $OUT/hybridep-facts.json)"
  else
    local why="test exit $rc"; [ "$rc" = 124 ] && why="test killed after ${RUN_TIMEOUT} s"
    status "stopped: $why; see $log and $OUT/hybridep-facts.json"
    grep -E '^(FAILED|ERROR|E  )' "$log" | head -40 >>"$OUT/hybridep-status.txt"
  fi
  exit "$rc"
}

case ${1:-} in
  prepare) prepare ;;
  build) build ;;
  run) run ;;
  probe) probe ;;
  kernels) kernels ;;
  exec) shift; device_env >/dev/null; kernel_env
    export PYTHONPATH=$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}; exec "$@" ;;
  *) sed -n '2,19p' "$0" >&2; exit 2 ;;
esac
