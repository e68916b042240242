"""Why the ``megatron`` rollout backend decodes short rollouts slower than ``hf``: both backends
in this one process on the same weights, timed and profiled (no worker processes, so the
profiler sees every kernel).

The default GPU run's rollout shape: a Qwen2-0.5B-shaped policy (24 layers, hidden 896, 14 heads
/ 2 KV groups, SwiGLU 4864) with the character vocabulary, bf16, torch layer spec; 256 prompts of
6 to 9 tokens, 16 new tokens each, one chunk. Prints, per backend, the min and median seconds
of 5 ``generate`` calls (after a warm-up call), then for one profiled call the GPU's busy time
(sum of kernel self times), the kernel launches and the top ops by host time: whether decoding
is bound by the GPU or by the host.

    python3 scripts/gpu/decode_profile.py               # one GPU
    SMOKE=1 python3 scripts/gpu/decode_profile.py       # CPU smoke run: 2 layers, 8 prompts, fp32
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.config.schema import (  # noqa: E402
    GenerationConfig, MegatronConfig, ModelArchConfig, OptimizerConfig)
from mcore_rl.data.tokenizer import build_char_tokenizer  # noqa: E402
from mcore_rl.distributed.worker_group import free_port  # noqa: E402
from mcore_rl.generation.hf import HFGenerationBackend  # noqa: E402
from mcore_rl.megatron.conversion import arch_to_hf_config  # noqa: E402
from mcore_rl.workers.policy import PolicyWorker  # noqa: E402

SMOKE = os.environ.get("SMOKE") == "1"


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    device = "cpu" if SMOKE else "cuda"
    sync = (lambda: None) if SMOKE else torch.cuda.synchronize
    tok = build_char_tokenizer()
    vocab = len(tok)
    arch = ModelArchConfig(family="qwen2", num_layers=2 if SMOKE else 24, hidden_size=896,
                           num_attention_heads=14, num_query_groups=2, ffn_hidden_size=4864,
                           max_position_embeddings=2048, rope_theta=1000000.0, qkv_bias=True,
                           tie_word_embeddings=True, vocab_size=vocab)
    worker = PolicyWorker(
        hf_path=None, hf_config=arch_to_hf_config(arch, vocab).to_dict(), vocab_size=vocab,
        arch=arch, megatron=MegatronConfig(precision="fp32" if SMOKE else "bf16", layer_spec="torch"),
        optimizer=OptimizerConfig(), device=device, seed=1, total_optimizer_steps=10,
        global_batch_size=256, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    rows = 8 if SMOKE else 256
    gen = GenerationConfig(max_new_tokens=16, batch_size=rows)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab - 1, (int(k),), generator=g).tolist()
               for k in torch.randint(6, 10, (rows,), generator=g)]
    ends = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_total_length=64)
    hf = HFGenerationBackend(arch_to_hf_config(arch, vocab), gen, device=device,
                             dtype=torch.float32 if SMOKE else torch.bfloat16, **ends)
    hf.update_weights(worker.get_hf_weights().items())
    backends = {"megatron": lambda: worker.generate(prompts, 0, 1, False, cfg=gen, **ends),
                "hf": lambda: hf.generate(prompts, seed=1)}
    for name, generate in backends.items():
        generate()
        sync()
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            generate()
            sync()
            seconds.append(time.perf_counter() - start)
        print(f"{name} generate {rows} x 16: min {min(seconds):.3f} s, median "
              f"{sorted(seconds)[2]:.3f} s", flush=True)
    for name, generate in backends.items():
        activities = [ProfilerActivity.CPU] + ([] if SMOKE else [ProfilerActivity.CUDA])
        with profile(activities=activities) as prof:
            generate()
            sync()
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e3
        host = sum(e.self_cpu_time_total for e in events) / 1e3
        launches = sum(e.count for e in events if "LaunchKernel" in e.key)
        print(f"== {name}: GPU busy {busy:.1f} ms, host ops {host:.1f} ms, {launches} kernel "
              f"launches")
        print(events.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
