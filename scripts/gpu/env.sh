# shellcheck shell=bash
# Sourced by the scripts of scripts/gpu/ at the start of a device call: installs the wheels
# carried in .whl/ (or $WHEELS: megatron-core and what the GPU image lacks) into /tmp/site, puts them and
# the checkout on PYTHONPATH, keeps NVLink multicast off for NCCL, and makes OUT (logs).
set -o pipefail
# A later call of the same warm machine may carry no wheels: /tmp/site has them already.
if [ -d "${WHEELS:-.whl}" ] || [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${WHEELS:-.whl}"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/mcore_rl_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
