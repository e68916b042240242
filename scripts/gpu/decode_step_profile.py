"""Kernels and milliseconds per decode step of the ``megatron`` rollout decoder at the GSM8K
step's shape (issue 37), for each decoding variant, in one process on one GPU.

The shape: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 heads / 3 KV groups, SwiGLU
1536, vocabulary 49,152, tied embeddings; seeded random weights, or ``--model DIR``'s), bf16,
torch layer spec, CUDA graphs; 32 prompts of 80-200 tokens x 8 responses each (GRPO's groups,
adjacent), 256 new tokens with ``generation.ignore_eos`` (every row runs all 255 decode steps:
the same work in every variant), temperature 0.7, one chunk of 256 rows.

Variants (``--variants``, comma-separated): ``base`` (the decoder as before issue 37),
``compile`` (``generation.compile_decode``; since the dec37 branch its KV-cache write is part of
the compiled RoPE kernel), ``shared`` (``generation.shared_prompt_kv``), ``compile+shared``,
``blocks`` (``generation.block_sampling``: the two-level inverse transform), ``compile+blocks``,
``compile+autotune`` (``generation.compile_decode_mode=max-autotune-no-cudagraphs``: Inductor
autotunes the layers' matrix products, Triton templates against cuBLAS; its warm-up compiles
longer), ``compile+autotune+blocks``, ``compile+flex`` (``generation.decode_attention=flex``:
the layers' attention over the KV cache as one FlexAttention kernel, Inductor's split-KV
decoding kernel, instead of two cuBLAS batched products around a softmax kernel; its attention
half compiles once per row bucket), ``compile+flex+blocks``, ``compile+triton`` and
``compile+triton+blocks`` (``generation.decode_attention=triton``: one Triton flash-decoding
kernel a layer), ``compile+shared+blocks``, ``compile+shared+triton+blocks``,
``compile+shared+rope+blocks`` (``decode_attention=triton_rope``: RoPE and the KV-cache write in
the attention's kernel, 8 kernels a layer instead of 10). Per variant: a warm-up call
(compiles, captures every graph), then ``--repeats`` timed calls (median wall seconds; ms per
decode step = wall / 255, prefill included), then one call under the torch profiler: kernels and
device milliseconds per decode step (the call's kernels / 255, prefill's few included) and the
top 10 kernels by device time; ``replay_ms``: the device time of one decode step of the largest
row bucket and span, its graph replayed back to back (no host in the way).
Each variant's rollout is checked against ``base``'s (same seed): rows whose tokens are all
equal, and the largest |logprob difference| over each row's tokens up to its first differing
token (the bound of a variant that is not bit for bit).

Prints one table, the top kernels per variant, and last a ``RESULT {...}`` JSON line. A
variant that raises (a compile, a capture) is reported FAILED with its error and the others
still run (exit status 1); a failing ``base`` ends the run.

    python3 scripts/gpu/decode_step_profile.py [--variants base,compile,blocks,compile+blocks]
    SMOKE=1 python3 scripts/gpu/decode_step_profile.py   # CPU: 2 layers, 16 rows, fp32, no profile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.config.schema import (  # noqa: E402
    GenerationConfig, MegatronConfig, ModelArchConfig, OptimizerConfig)
from mcore_rl.distributed.worker_group import free_port  # noqa: E402
from mcore_rl.generation.megatron import MegatronDecoder  # noqa: E402
from mcore_rl.megatron.conversion import arch_to_hf_config  # noqa: E402
from mcore_rl.workers.policy import PolicyWorker  # noqa: E402

SMOKE = os.environ.get("SMOKE") == "1"
VOCAB = 49152
SMOLLM2 = ModelArchConfig(family="llama", num_layers=2 if SMOKE else 30, hidden_size=576,
                          num_attention_heads=9, num_query_groups=3, ffn_hidden_size=1536,
                          max_position_embeddings=2048, rope_theta=100000.0, qkv_bias=False,
                          tie_word_embeddings=True, vocab_size=VOCAB)
AUTOTUNE = "max-autotune-no-cudagraphs"  # generation.compile_decode_mode
VARIANTS = {"base": {}, "compile": {"compile_decode": True},
            "shared": {"shared_prompt_kv": True},
            "compile+shared": {"compile_decode": True, "shared_prompt_kv": True},
            "blocks": {"block_sampling": True},
            "compile+blocks": {"compile_decode": True, "block_sampling": True},
            "compile+autotune": {"compile_decode": True, "compile_decode_mode": AUTOTUNE},
            "compile+autotune+blocks": {"compile_decode": True, "compile_decode_mode": AUTOTUNE,
                                        "block_sampling": True},
            "compile+flex": {"compile_decode": True, "decode_attention": "flex"},
            "compile+flex+blocks": {"compile_decode": True, "decode_attention": "flex",
                                    "block_sampling": True},
            "compile+triton": {"compile_decode": True, "decode_attention": "triton"},
            "compile+triton+blocks": {"compile_decode": True, "decode_attention": "triton",
                                      "block_sampling": True},
            "compile+shared+blocks": {"compile_decode": True, "shared_prompt_kv": True,
                                      "block_sampling": True},
            "compile+shared+triton+blocks": {"compile_decode": True, "shared_prompt_kv": True,
                                             "decode_attention": "triton",
                                             "block_sampling": True},
            "compile+shared+rope+blocks": {"compile_decode": True, "shared_prompt_kv": True,
                                           "decode_attention": "triton_rope",
                                           "block_sampling": True}}


def _worker(model_dir):
    from transformers import AutoConfig

    hf_config = (AutoConfig.from_pretrained(model_dir).to_dict() if model_dir
                 else arch_to_hf_config(SMOLLM2, VOCAB).to_dict())
    return PolicyWorker(
        hf_path=model_dir, hf_config=hf_config, vocab_size=VOCAB, arch=SMOLLM2,
        megatron=MegatronConfig(precision="fp32" if SMOKE else "bf16", layer_spec="torch"),
        optimizer=OptimizerConfig(), device="cpu" if SMOKE else "cuda", seed=1,
        total_optimizer_steps=10, global_batch_size=256, rank=0, world_size=1,
        master_addr="127.0.0.1", master_port=free_port())


def _profile(generate) -> dict:
    """Kernels, device ms and the top 10 kernels (name, count, device us) of one call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict = {}
    for e in kernels:
        count, us = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (count + 1, us + e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:10]
    return {"kernels": len(kernels),
            "device_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3,
            "top": [(name[:90], count, round(us)) for name, (count, us) in top]}


def _replay_ms(decoder, n: int = 50) -> float:
    """Device ms of one decode step with no host in the way: the graph of the largest row
    bucket and span replayed ``n`` times back to back, timed by CUDA events (on the buffers'
    last state: the next call prefills them again). Against ``ms_per_step`` (wall, the host's
    loop included) it says whether the loop waits for the host; against
    ``device_ms_per_step`` (the kernels' own time) what the gaps between them cost."""
    mode = None if decoder._layers is None else decoder._layers_mode
    # this variant's graphs (the decoder keeps the earlier variants' when the buffers stay)
    mine = [k for k in decoder._graphs if k[-1] == mode]
    if not mine:
        return float("nan")
    key = max(mine, key=lambda k: (k[0], k[1] if isinstance(k[1], int) else k[1][:2]))
    from flash_decode_bench import replay_ms  # scripts/gpu/, this script's folder

    return round(replay_ms(decoder._graphs[key], n), 3)


def _against(base, out) -> dict:
    """Rows equal to ``base``'s, and the largest |logprob diff| up to each row's first
    differing token."""
    equal, worst = 0, 0.0
    for a, b in zip(base, out):
        n = min(len(a.tokens), len(b.tokens))
        diff = (a.tokens[:n] != b.tokens[:n]).nonzero()
        upto = int(diff[0]) if len(diff) else n
        equal += int(upto == n and len(a.tokens) == len(b.tokens))
        if upto:
            worst = max(worst, float((a.logprobs[:upto] - b.logprobs[:upto]).abs().max()))
    return {"rows_equal": equal, "max_logprob_diff": worst}


def _measure(worker, prompts, cfg, args, steps: int, sync):
    """One variant: a warm-up call (compiles, captures; its rollout is returned), the median
    wall seconds of ``args.repeats`` calls, and (on the GPU) one call under the profiler.
    Returns ``(rollout, figures)``."""
    def generate():
        return worker.generate(prompts, 0, 1, False, decoder=MegatronDecoder, cfg=cfg,
                               eos_token_id=[], pad_token_id=0,
                               max_total_length=200 + args.max_new_tokens)

    start = time.perf_counter()
    rollout = generate()
    sync()
    warm = time.perf_counter() - start
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        generate()
        sync()
        seconds.append(time.perf_counter() - start)
    wall = statistics.median(seconds)
    r = {"warmup_s": round(warm, 2), "wall_s": round(wall, 4),
         "ms_per_step": round(wall / steps * 1e3, 3),
         "tokens_per_s": round(len(prompts) * args.max_new_tokens / wall)}
    if not SMOKE:
        r["replay_ms"] = _replay_ms(worker._decoder)
        prof = _profile(generate)
        r.update(kernels_per_step=round(prof["kernels"] / steps, 1),
                 device_ms_per_step=round(prof["device_ms"] / steps, 3), top=prof["top"])
    return rollout, r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="SmolLM2-135M-Instruct HF directory "
                   "(default: seeded random weights of its shape)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompts", type=int, default=2 if SMOKE else 32)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16 if SMOKE else 256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    if "base" not in variants:
        variants.insert(0, "base")
    import megatron.core

    print(f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
          f"{'cpu' if SMOKE else torch.cuda.get_device_name()}", flush=True)
    worker = _worker(args.model)
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(3, VOCAB - 1, (int(n),), generator=g).tolist()
                for n in torch.randint(80, 201, (args.prompts,), generator=g)]
    prompts = [q for q in distinct for _ in range(args.generations)]
    rows, steps = len(prompts), args.max_new_tokens - 1
    sync = (lambda: None) if SMOKE else torch.cuda.synchronize
    results, outputs = {}, {}
    failed = []
    for name in variants:
        try:
            cfg = GenerationConfig(temperature=0.7, max_new_tokens=args.max_new_tokens,
                                   batch_size=rows, ignore_eos=True, **VARIANTS[name])
            outputs[name], r = _measure(worker, prompts, cfg, args, steps, sync)
        except Exception as error:  # a variant that fails (a compile, a capture) ends only itself
            if name == "base":  # every other variant is compared against base's rollout
                raise
            traceback.print_exc()
            failed.append(name)
            print(f"{name}: FAILED {type(error).__name__}: {' '.join(str(error).split())[:300]}",
                  flush=True)
            continue
        r.update(_against(outputs["base"], outputs[name]))
        results[name] = r
        print(f"{name}: {json.dumps({k: v for k, v in r.items() if k != 'top'})}", flush=True)

    print(f"\n== decode step, {rows} rows x {args.max_new_tokens} tokens ({steps} decode steps), "
          f"{SMOLLM2.num_layers} layers")
    cols = ("ms_per_step", "replay_ms", "kernels_per_step", "device_ms_per_step", "tokens_per_s",
            "warmup_s", "rows_equal", "max_logprob_diff")
    print(f"{'variant':24s}" + "".join(f"{c:>20s}" for c in cols))
    for name, r in results.items():
        print(f"{name:24s}" + "".join(f"{str(r.get(c, '-')):>20s}" for c in cols))
    for name in failed:
        print(f"{name:24s}  FAILED (its error above)")
    for name, r in results.items():
        if "top" in r:
            print(f"\n== top 10 kernels, {name} (count per step, device us per step)")
            for kernel, count, us in r["top"]:
                print(f"  {count / steps:8.1f} {us / steps:10.1f}  {kernel}")
    print("RESULT " + json.dumps({"rows": rows, "steps": steps, "variants": results,
                                  "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
