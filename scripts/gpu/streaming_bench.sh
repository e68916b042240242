#!/usr/bin/env bash
# One device call: the streaming GRPO loop against the synchronous one on one GPU
# (bench/streaming.py; bench/RESULTS.md "Streaming GRPO loop ... (one GPU)").
#   run(command="bash scripts/gpu/streaming_bench.sh", carry=[".whl"])
# grpo_synthetic_gpu's 0.36B model with 128-token responses: no warm start, so the untrained
# policy rarely ends a response early and every step decodes 256 x 128 tokens. The synchronous
# modes decode in the controller's process (hf) or the policy's (megatron) on the policy's GPU;
# the streaming modes' hf process shares it (cluster.colocate_generation=true: both resident). Extra arguments go to bench/streaming.py (e.g. --steps 4).
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
python3 bench/streaming.py --config grpo_synthetic_gpu --steps "${STEPS:-6}" \
    --modes "${MODES:-sync,sync_megatron,stream0,stream1}" \
    --set generation.backend=hf generation.max_new_tokens=128 data.max_total_length=136 \
          model.arch.max_position_embeddings=160 --stream-set cluster.colocate_generation=true "$@" \
    2>&1 | tee "$OUT/streaming_bench.log" | grep -v -i warn
