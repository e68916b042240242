# shellcheck shell=bash
# Sourced by the scripts of scripts/gpu/ at the start of a device call: installs the wheels
# carried in .whl/ (or $WHEELS: megatron-core and what the GPU image lacks) into /tmp/site, puts them and
# the checkout on PYTHONPATH, keeps NVLink multicast off for NCCL, and makes OUT (logs).
set -o pipefail
# A later call of the same warm machine may carry no wheels: /tmp/site has them already. The
# machine keeps an ignored folder such as .whl/ between calls, so the install runs only when the
# wheels differ from the last install's (names and sizes, /tmp/site/.wheels): a reinstall
# (--upgrade) rewrites megatron-core under a background stage (bg:) that imports it, which
# failed one such run with "No module named 'megatron.core.transformer'" (2026-11-28).
wheels_stamp=$(find "${WHEELS:-.whl}" -maxdepth 1 -type f -name '*.whl' -printf '%s %f\n' 2>/dev/null | sort)
if [ ! -d /tmp/site ] || { [ -n "$wheels_stamp" ] \
        && [ "$wheels_stamp" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; }; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${WHEELS:-.whl}"/*.whl || exit 1
    printf '%s\n' "$wheels_stamp" > /tmp/site/.wheels
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/mcore_rl_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
