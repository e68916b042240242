#!/usr/bin/env bash
# One device call on a 4-GPU machine: the GPU acceptance runs that need several GPUs, packed so
# that no GPU idles and no timing shares a GPU.
#   run(command="bash scripts/gpu/multi_gpu.sh", kind="nvidia-h200-x4", carry=[".whl"])
#
#   GPUs 0-3  scripts/gpu/layout_parity.py: TP/PP/DP layouts against one GPU (bf16, distributed
#             optimizer, overlap_grad_reduce, overlap_param_gather); numbers only, no timing
#   GPU 3     the GPU main job (no Ray, no TensorBoard: the image lacks both), from the start: configs/grpo_synthetic_gpu.yaml (Qwen2-0.5B shape)
#             and, beside it, the default run (configs/grpo_synthetic.yaml) moved to the GPU
#   then      bench/split_step.py, 1B preset, split vs sync train step: DP=2 on GPUs 0,1, then DP=1
#             on GPU 0 (one at a time: the host's CPUs and links are shared)
#
# Each part has a time limit (main jobs 480 s, the others 300 s) so the call ends inside 10 min.
# Variables: OUT (logs, default /tmp/mcore_rl_out), MAIN_JOB=0 skips the main jobs, LAYOUTS=0
# skips the layout parity, SPLIT=0 skips the benchmark; extra main-job overrides in MAIN_ARGS.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/mcore_rl_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
quiet() { grep -v -i -E "warn|deprecat|^\s*$"; }

main_pids=()
if [ "${MAIN_JOB:-1}" != 0 ]; then
    for name in grpo_synthetic_gpu grpo_synthetic; do
        # shellcheck disable=SC2086  # MAIN_ARGS is a list of overrides
        CUDA_VISIBLE_DEVICES=3 timeout 480 python3 -m mcore_rl train --config-name "$name" cluster.device=cuda \
            cluster.use_ray=false logging.progress=false logging.tensorboard=false \
            policy.megatron.precision=bf16 \
            policy.megatron.layer_spec=torch run.output_dir="/tmp/runs/$name" ${MAIN_ARGS:-} \
            > "$OUT/main_$name.log" 2>&1 &
        main_pids+=($!)
    done
fi

status=0
if [ "${LAYOUTS:-1}" != 0 ]; then
    timeout 300 python3 scripts/gpu/layout_parity.py 2>&1 | tee "$OUT/layout_parity.log" | quiet || status=1
fi

if [ "${SPLIT:-1}" != 0 ]; then
    split=(bench/split_step.py --preset 1b --device cuda --precision bf16 --layer-spec torch
           --distributed-optimizer --overlap-grad-reduce --parity --steps 20 --warmup 3)
    for dp in 2 1; do
        CUDA_VISIBLE_DEVICES=0,1 timeout 240 python3 "${split[@]}" --dp $dp > "$OUT/split_dp$dp.log" 2>&1 || status=1
        echo "== split step, DP=$dp"; quiet < "$OUT/split_dp$dp.log" | tail -n 12
    done
fi

for i in "${!main_pids[@]}"; do wait "${main_pids[$i]}" || status=1; done
for name in grpo_synthetic_gpu grpo_synthetic; do
    [ -f "$OUT/main_$name.log" ] || continue
    echo "== main job $name"
    grep -v -i -E "warn|deprecat" "$OUT/main_$name.log" | grep -v "^sft step" | tail -n 14
    cp "/tmp/runs/$name/metrics.jsonl" "$OUT/metrics_$name.jsonl" 2>/dev/null
done
exit $status
