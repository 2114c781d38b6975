#!/usr/bin/env bash
# Runs the gpu-marked tests on a CUDA machine (on the lent H200: from the repo root, with .whl
# carried). Extra arguments go to pytest. The log lands in $OUT (or ./out) as gpu-tests.log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/device-env.sh
source scripts/device-env.sh
# Real Transformer Engine when it was staged (scripts/device-te.sh): TE-marked tests must then run, not skip.
if [ -f .te-device/w/install-on-device.sh ] && { [ -d /tmp/te ] || [ -d /tmp/site/transformer_engine ]; }; then
  bash scripts/device-te.sh install
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} BUFREUSE_REQUIRE_TE=1
fi
out=${OUT:-out}
mkdir -p "$out"
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'
set -o pipefail
python3 -m pytest -m gpu -v -p no:cacheprovider -o addopts="-ra --strict-markers" "$@" 2>&1 | tee "$out/gpu-tests.log"
