#!/usr/bin/env bash
# Downloads the CPython 3.12 wheels the lent H200 needs (it has no network) into .whl/.
# scripts/device-env.sh installs whatever .whl/ holds with --no-deps into /tmp/site; carry .whl
# on the run. Only adds files: wheels other work put in .whl/ are left alone.
# Usage: bash scripts/fetch-device-wheels.sh        (MEGATRON_CORE_VERSION=0.19.2 by default)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
# megatron-core: torch, numpy, packaging and triton (its unconditional import) are already on the H200.
python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
  -d .whl "megatron-core==${MEGATRON_CORE_VERSION:-0.19.2}"
ls -1 .whl
