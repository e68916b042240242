#!/usr/bin/env bash
# One device call: mcore-rl and Hugging Face TRL's GRPOTrainer (pinned 1.16.0) side by side on
# the same work (SmolLM2 GSM8K: 32 prompts x 8 generations, <= 256 new tokens, lr 1e-6, bf16,
# no KL), then a table of seconds per step, tokens/s and the ratio, last.
#   run(command="bash scripts/gpu/peer_bench.sh MODEL_DIR GSM8K_DIR", carry=[".whl", ...])
# GSM8K_DIR holds train.jsonl and test.jsonl. mcore-rl's wheels come from .whl (scripts/gpu/env.sh);
# TRL's (bench/peers/requirements-gpu.txt) from $TRL_WHEELS (default .carry-trl) when that
# folder exists, else they must already be under /tmp/site. MODES (default "hf vllm"): TRL's
# generation modes; vllm runs only where `import vllm` works. STEPS (7) and WARMUP (2) for all;
# MCORE_TIMEOUT / TRL_TIMEOUT (seconds, 240 each) bound each run. JSON and logs go to $OUT.
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
model=${1:?MODEL_DIR}; data=${2:?GSM8K_DIR with train.jsonl and test.jsonl}
trl_wheels=${TRL_WHEELS:-.carry-trl}
if [ -d "$trl_wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$trl_wheels"/*.whl || exit 1
fi
export STEPS=${STEPS:-7} WARMUP=${WARMUP:-2}
status=0
timeout "${MCORE_TIMEOUT:-240}" bash bench/peers/mcore_rl_step.sh "$model" "$data/train.jsonl" \
    "$data/test.jsonl" || status=1
results=("$OUT/mcore_rl_step.json")
for mode in ${MODES:-hf vllm}; do
    if [ "$mode" = vllm ] && ! python3 -c "import vllm" 2>/dev/null; then
        echo "TRL vllm mode skipped: vllm is not importable here"; continue
    fi
    cmd=(python3 bench/peers/trl_grpo.py --model "$model" --data "$data/train.jsonl" --mode "$mode"
         --steps "$STEPS" --warmup "$WARMUP")
    echo "${cmd[*]}"
    timeout "${TRL_TIMEOUT:-240}" "${cmd[@]}" 2>&1 | tee "$OUT/trl_grpo_$mode.log" \
        | grep -v -i "warn" || status=1
    results+=("$OUT/trl_grpo_$mode.json")
done
echo
python3 bench/peers/summarize.py table "${results[@]}"
exit $status
