#!/usr/bin/env bash
# mcore-rl on the peer benchmark's work (the same as bench/peers/trl_grpo.py): GRPO on GSM8K,
# 32 prompts x 8 generations per RL step, <= 256 new tokens, prompts <= 256 tokens, lr 1e-6
# (AdamW, constant), bf16, no KL, megatron rollouts, torch layer spec, one process.
#   bash bench/peers/mcore_rl_step.sh MODEL_DIR GSM8K_TRAIN_JSONL GSM8K_TEST_JSONL [overrides...]
# STEPS (default 7) RL steps; WARMUP (default 2) first steps left out of the median. Writes
# $OUT/$NAME.json (NAME default mcore_rl_step: median seconds per step and per phase, tokens/s)
# and the run's log $OUT/$NAME.log, labelled MODE (default megatron) in the tables; the run
# directory is $RUN_DIR (default /tmp/peer_$NAME, replaced).
set -o pipefail
model=${1:?MODEL_DIR}; train=${2:?GSM8K train jsonl}; test=${3:?GSM8K test jsonl}; shift 3
OUT=${OUT:-/tmp/mcore_rl_out}; mkdir -p "$OUT"
steps=${STEPS:-7}; name=${NAME:-mcore_rl_step}; run_dir=${RUN_DIR:-/tmp/peer_$name}
rm -rf "$run_dir"
args=(--config-name grpo_gsm8k model.hf_path="$model" cluster.device=cuda cluster.use_ray=false
      generation.backend=megatron policy.megatron.precision=bf16 policy.megatron.layer_spec=torch
      grpo.num_prompts_per_step=32 grpo.num_generations=8 generation.max_new_tokens=256
      data.max_prompt_length=256 data.max_total_length=512 policy.optimizer.lr=1e-6
      data.train_path="$train" data.test_path="$test"
      grpo.max_steps="$steps" grpo.val_every=0 grpo.val_at_start=false
      run.output_dir="$run_dir" "$@")
echo "mcore-rl train ${args[*]}"
python3 -m mcore_rl train "${args[@]}" 2>&1 | tee "$OUT/$name.log" | grep -v -i warn
status=$?
python3 bench/peers/summarize.py mcore-rl "$run_dir/metrics.jsonl" --warmup "${WARMUP:-2}" \
    --command "mcore-rl train ${args[*]}" --json "$OUT/$name.json" --mode "${MODE:-megatron}"
exit $(( status || $? ))
