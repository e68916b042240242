#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU checks, print the benchmark table.
#   run(command="bash scripts/gpu/run_bench.sh [bench args]", carry=[".whl"])
# CHECKS=0 skips scripts/gpu/checks.py; logs and bench_table.json go to $OUT.
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
status=0
if [ "${CHECKS:-1}" != 0 ]; then
    python3 scripts/gpu/checks.py 2>&1 | tee "$OUT/checks.log" | grep -v Warning
    status=$?
fi
python3 bench/train_step.py "$@" 2>&1 | tee "$OUT/bench.log" | grep -v -i warn
exit $(( status || $? ))
