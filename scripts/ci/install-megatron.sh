#!/usr/bin/env bash
# Installs a real megatron-core into the active environment for the integration tests, plus a
# 0.16.x copy in .venv-megatron016/ for the older field set (tests/test_config.py runs it in a
# subprocess with that folder on PYTHONPATH).
#
# Why these flags: megatron-core 0.19.x declares Python >= 3.12 but ships a cp311 wheel that
# installs and imports on 3.11, so on 3.11 we pass --ignore-requires-python to that one package
# (installed with --no-deps; its real dependencies are torch, numpy and packaging). It imports triton
# unconditionally (transformer/moe/ops/paged_stash.py), so triton comes too; it imports on CPU.
# Usage: bash scripts/ci/install-megatron.sh   (MEGATRON_CORE_VERSION overrides 0.19.2)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
version=${MEGATRON_CORE_VERSION:-0.19.2}
flags=()
if ! python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  flags+=(--ignore-requires-python)
fi
# Dependencies first, resolved normally (--ignore-requires-python is global to a pip call and would
# let pip pick a numpy that needs 3.12), then megatron-core alone with --no-deps.
python -m pip install -q "torch>=2.6" numpy "packaging>=24.2" triton
python -m pip install -q --no-deps "${flags[@]}" "megatron-core==${version}"
python -m pip install -q --no-deps --ignore-requires-python --upgrade --target .venv-megatron016 "megatron-core==0.16.1"
python - <<'PY'
import warnings
warnings.filterwarnings("ignore")
import megatron.core
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: F401 - the import the tests need
print("install-megatron: megatron-core", megatron.core.__version__, "(+ 0.16.1 in .venv-megatron016/)")
PY
