#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU checks, print the benchmark table.
#   run(command="bash scripts/gpu/run_bench.sh [bench args]", carry=[".whl"])
# CHECKS=0 skips scripts/gpu/checks.py; logs and bench_table.json go to $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/mcore_rl_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0
if [ "${CHECKS:-1}" != 0 ]; then
    python3 scripts/gpu/checks.py 2>&1 | tee "$OUT/checks.log" | grep -v Warning
    status=$?
fi
python3 bench/train_step.py "$@" 2>&1 | tee "$OUT/bench.log" | grep -v -i warn
exit $(( status || $? ))
