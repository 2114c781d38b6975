# Source on a CUDA machine with no network (the lent H200): makes this checkout importable and
# runnable as `bufreuse` without pip reaching an index. Wheels carried in .whl/ are installed
# into /tmp/site first (see scripts/fetch-device-wheels.sh).
# Usage: source scripts/device-env.sh
_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if compgen -G "$_repo/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$_repo"/.whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$_repo${PYTHONPATH:+:$PYTHONPATH}
mkdir -p /tmp/bufreuse-bin
printf '#!/bin/sh\nexec python3 -m bufreuse "$@"\n' >/tmp/bufreuse-bin/bufreuse
chmod +x /tmp/bufreuse-bin/bufreuse
export PATH=/tmp/bufreuse-bin:$PATH
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared multi-GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
