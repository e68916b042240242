"""vLLM 0.24.0 on one GPU, before mcore-rl drives it (issue 23): start an engine on a Hugging Face
model directory (bf16, sleep mode on), decode 256 chat prompts of GSM8K-like length to <= 256
tokens (temperature 1, seeded), then sleep (level 1) and wake up, printing the GPU memory the
process sees free before and after each (torch.cuda.mem_get_info) and the decode tokens/s.

    python3 scripts/gpu/vllm_smoke.py MODEL_DIR
"""

from __future__ import annotations

import sys
import time

import torch


def free_gib() -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


def main(model_dir: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    print(f"free before the engine: {free_gib():.1f} GiB")
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=544,
              max_num_seqs=256, enable_sleep_mode=True, seed=0, logprobs_mode="processed_logprobs")
    print(f"engine up in {time.perf_counter() - t0:.1f} s; free: {free_gib():.1f} GiB")
    prompts = [TokensPrompt(prompt_token_ids=[1] + [(17 * i + 31 * j) % 40000 + 100 for j in range(150)])
               for i in range(256)]
    params = [SamplingParams(max_tokens=256, temperature=1.0, seed=i, logprobs=0, ignore_eos=True)
              for i in range(256)]
    for attempt in range(2):  # the first call warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"decode {attempt}: 256 x 256 tokens: {tokens} tokens in {seconds:.2f} s = "
              f"{tokens / seconds:,.0f} tokens/s")
    lp = outs[0].outputs[0].logprobs[0]
    print(f"first logprob entry: {lp}")
    before = free_gib()
    t0 = time.perf_counter()
    llm.sleep(level=1)
    print(f"sleep(level=1) in {time.perf_counter() - t0:.2f} s: free {before:.1f} -> {free_gib():.1f} GiB")
    t0 = time.perf_counter()
    llm.wake_up()
    print(f"wake_up in {time.perf_counter() - t0:.2f} s: free {free_gib():.1f} GiB")
    outs = llm.generate(prompts[:4], params[:4], use_tqdm=False)
    print(f"after wake-up: {sum(len(o.outputs[0].token_ids) for o in outs)} tokens decoded")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
