#!/usr/bin/env bash
# One device call that runs the GPU acceptance checks, in an order that keeps every timing on
# GPUs of its own:
#   run(command="bash scripts/gpu/acceptance.sh", kind="nvidia-h200-x4", carry=[".whl"])
#   run(command="PARTS='split main generation' bash scripts/gpu/acceptance.sh", kind="nvidia-h200", ...)
#
# Parts (PARTS, default "layouts split main generation"; each skipped when the GPUs are too few):
#   layouts     scripts/gpu/layout_parity.py: TP/PP/DP layouts against one GPU (bf16, distributed
#               optimizer, overlap_grad_reduce, overlap_param_gather); 4 GPUs; numbers only
#   split       bench/split_step.py, 1.1B preset, split vs sync train step at DP=2 (2 GPUs) then
#               DP=1, one at a time (the host's CPUs and links are shared)
#   main        the GPU main job: configs/grpo_synthetic_gpu.yaml (Qwen2-0.5B shape) and, beside
#               it, the default run (configs/grpo_synthetic.yaml) moved to the GPU; no Ray, no
#               TensorBoard (the image lacks both); on the last GPU, while the checks below run
#   generation  scripts/gpu/megatron_generation.py (the megatron rollout backend), on GPU 0
# The layout parity shares its GPUs with the main jobs (it times nothing); the split-step
# benchmark runs before the main jobs start.
#
# Other variables: OUT (logs, default /tmp/mcore_rl_out), MAIN_JOBS (config names, default
# "grpo_synthetic_gpu grpo_synthetic"), MAIN_ARGS (extra main-job overrides), MAIN_TIMEOUT
# (seconds, default 420), SPLIT_ARGS (bench options, default "--parity --steps 20 --warmup 3").
# Time limits: layouts 300 s, each split run 240 s, generation 300 s.
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
PARTS=" ${PARTS:-layouts split main generation} "
ngpu=$(nvidia-smi --list-gpus | wc -l)
quiet() { grep -v -i -E "warn|deprecat|evict|MimoModel|full_param_layout|grad_input|^\s*$"; }
want() { [[ $PARTS == *" $1 "* ]]; }
status=0

if want split; then
    read -r -a split_args <<< "${SPLIT_ARGS:---parity --steps 20 --warmup 3}"
    split=(bench/split_step.py --preset 1b --device cuda --precision bf16 --layer-spec torch
           --distributed-optimizer --overlap-grad-reduce "${split_args[@]}")
    dps=(1); (( ngpu >= 2 )) && dps=(2 1)
    for dp in "${dps[@]}"; do
        CUDA_VISIBLE_DEVICES=0,1 timeout 240 python3 "${split[@]}" --dp "$dp" > "$OUT/split_dp$dp.log" 2>&1 || status=1
        echo "== split step, DP=$dp"; quiet < "$OUT/split_dp$dp.log" | tail -n 8
    done
fi

read -r -a main_jobs <<< "${MAIN_JOBS:-grpo_synthetic_gpu grpo_synthetic}"
main_pids=()
if want main; then
    for name in "${main_jobs[@]}"; do
        # shellcheck disable=SC2086  # MAIN_ARGS is a list of overrides
        CUDA_VISIBLE_DEVICES=$((ngpu - 1)) timeout "${MAIN_TIMEOUT:-420}" python3 -m mcore_rl train --config-name "$name" \
            cluster.device=cuda cluster.use_ray=false logging.progress=false logging.tensorboard=false \
            policy.megatron.precision=bf16 policy.megatron.layer_spec=torch \
            run.output_dir="/tmp/runs/$name" ${MAIN_ARGS:-} > "$OUT/main_$name.log" 2>&1 &
        main_pids+=($!)
    done
fi

if want layouts && (( ngpu >= 4 )); then
    timeout 300 python3 scripts/gpu/layout_parity.py 2>&1 | tee "$OUT/layout_parity.log" | quiet || status=1
fi

if want generation; then
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 scripts/gpu/megatron_generation.py > "$OUT/generation.log" 2>&1 || status=1
    echo "== megatron generation backend"; quiet < "$OUT/generation.log" | tail -n 14
fi

for pid in "${main_pids[@]}"; do wait "$pid" || status=1; done
for name in "${main_jobs[@]}"; do
    [ -f "$OUT/main_$name.log" ] || continue
    echo "== main job $name"
    quiet < "$OUT/main_$name.log" | grep -v "^sft step" | tail -n 14
    cp "/tmp/runs/$name/metrics.jsonl" "$OUT/metrics_$name.jsonl" 2>/dev/null
done
exit $status
