"""FP8 rollouts in vLLM against bf16 on one GPU (issue 34 item 3; ``generation.vllm.quantization``).

A policy of ``--shape`` (Qwen2 shapes, seeded Hugging Face initialisation, no checkpoint, bf16)
in one ``PolicyWorker`` process; after ``offload_before_refit`` (the colocated lifecycle) one
vLLM engine per ``--quantization`` (default ``none fp8``), one after the other, colocated on the
same GPU (``generation.backend=vllm`` as mcore-rl runs it: refit over CUDA IPC, a request per
row with its own seed), each:

1. refit from the policy (the engine starts from vLLM's dummy weights), then its linear layers
   as its kernels apply them (:meth:`~mcore_rl.generation.vllm.VLLMEngine.linear_weights`: FP8
   ones dequantized) in the first and last layer against the policy's bf16 weights (q/k/v and
   gate/up fused as vLLM fuses them): bf16 equal, FP8 within e4m3's rounding (half an ulp, 2^-4
   relative, subnormal steps of 2^-9 x the tensor's scale, the kernel's bf16 output rounding);
   ``PASS``/``FAIL`` per engine;
2. decode speed: ``--rollouts`` random prompts decoding every token of ``--max-new-tokens``
   (``ignore_eos``), a short warm-up call first: response tokens per second;
3. the trainer/rollout mismatch on those rollouts: the policy's ``get_logprobs`` against the
   engine's, NeMo RL's ``token_mult_prob_error`` and the max gap (random weights: the figures
   compare the two engines, not a trained model's; the GRPO runs give those).

Prints a table and a one-line JSON record (``RESULT {...}``); exit code: the failed checks.

    python3 scripts/gpu/vllm_fp8.py [--shape qwen1.5b] [--rollouts 256] [--max-new-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.config.schema import (  # noqa: E402
    GenerationConfig, MegatronConfig, ModelArchConfig, OptimizerConfig, VLLMConfig)
from mcore_rl.controller.logprob_budget import mismatch_figures  # noqa: E402
from mcore_rl.distributed.worker_group import DataParallelGroup, ProcessWorkerGroup  # noqa: E402
from mcore_rl.generation.vllm import VLLMGenerationBackend  # noqa: E402
from mcore_rl.megatron.conversion import arch_to_hf_config  # noqa: E402
from mcore_rl.workers.interfaces import VLLMEngineAPI  # noqa: E402
from mcore_rl.workers.policy import PolicyWorker  # noqa: E402
from passfail import FAILURES, check  # noqa: E402

VOCAB = 151936
SHAPES = {  # Qwen2-0.5B's, Qwen2-1.5B's and Qwen2-7B's width (vocabulary 151,936 here)
    "qwen0.5b": dict(num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2,
                     ffn_hidden_size=4864, tie_word_embeddings=True),
    "qwen1.5b": dict(num_layers=28, hidden_size=1536, num_attention_heads=12, num_query_groups=2,
                     ffn_hidden_size=8960, tie_word_embeddings=True),
    # Qwen2-7B's width at half its depth (14 of 28 layers, 4.4B parameters): where decoding reads
    # enough weight bytes a step for FP8's halving to show (1.5B's 3 GB a step took ~0.6 ms of a
    # ~10 ms decode step at 256 rows on an H200). Half depth keeps the policy's training state
    # (bf16 weights, fp32 main weights and gradients: ~10 bytes a parameter at build, ~44 GB,
    # before it goes to host for the refit; Adam's moments come at a first step this script
    # never takes) well inside an 80 GB H100; the whole 7.6B would be ~76 GB.
    "qwen7b-14l": dict(num_layers=14, hidden_size=3584, num_attention_heads=28,
                       num_query_groups=4, ffn_hidden_size=18944, tie_word_embeddings=False),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=2, num_query_groups=2,
                 ffn_hidden_size=64, tie_word_embeddings=True),  # the CPU smoke run's
}
EOS, PAD = VOCAB - 1, 0


def fused_reference(weights, layer: int):
    """``{vLLM module name: [out, in] float32}`` of the policy's HF tensors of ``layer``."""
    at = f"model.layers.{layer}."
    parts = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "self_attn.o_proj": ["self_attn.o_proj"],
             "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"], "mlp.down_proj": ["mlp.down_proj"]}
    return {at + fused: torch.cat([weights[f"{at}{p}.weight"] for p in names]).float()
            for fused, names in parts.items()}


def weights_check(engine, weights, layers, quantization) -> dict:
    """Check 1 (module docstring) on TP rank 0 (the whole tensors at TP 1): the largest error
    over ``layers``' linear weights, each held to its allowance (FP8: e4m3 rounding under the
    fused tensor's per-tensor scale max|w| / 448, vLLM's; a kernel that kept a scale per part
    rounds finer, within the same allowance)."""
    worst, ok = 0.0, True
    for layer in layers:
        reference = fused_reference(weights, layer)
        applied = engine.engines.call(VLLMEngineAPI).linear_weights(f"model.layers.{layer}.")[0]
        for name, ref in reference.items():
            got = applied.get(name)
            if got is None or got.shape != ref.shape:
                ok = False
                print(f"  {name}: {None if got is None else tuple(got.shape)} vs {tuple(ref.shape)}")
                continue
            error = (got - ref).abs()
            if quantization is None:
                allowed = torch.zeros_like(ref)
            else:
                scale = float(ref.abs().max()) / 448
                allowed = 2 ** -4 * ref.abs() + 2 ** -9 * scale + 2 ** -8 * got.abs()
            ok &= bool((error <= allowed).all())
            worst = max(worst, float(error.max()))
    check(f"engine {quantization or 'bf16'}: its linear weights are the policy's"
          f"{' within FP8 rounding' if quantization else ''}", ok,
          f"max |diff| {worst:.3g} over layers {layers}")
    return {"weights_max_abs_diff": worst, "weights_ok": ok}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen1.5b", choices=sorted(SHAPES))
    p.add_argument("--quantization", nargs="+", default=["none", "fp8"], choices=["none", "fp8"])
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--prompt-length", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--kv-cache-gb", type=float, default=8.0, help="generation.vllm.kv_cache_gb")
    p.add_argument("--enforce-eager", action="store_true", help="generation.vllm.enforce_eager")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run of the script (fp32, --quantization none, --shape tiny)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    precision = "bf16" if cuda else "fp32"
    arch = ModelArchConfig(family="qwen2", max_position_embeddings=32768, rope_theta=1000000.0,
                           qkv_bias=True, vocab_size=VOCAB, **SHAPES[args.shape])
    device = torch.cuda.get_device_name() if cuda else "cpu"
    if cuda:
        device += f" (capability {'.'.join(map(str, torch.cuda.get_device_capability()))})"
    print(f"torch {torch.__version__}, {device}, shape {args.shape}", flush=True)
    group = DataParallelGroup(ProcessWorkerGroup(PolicyWorker, 1, dict(
        hf_path=None, hf_config=arch_to_hf_config(arch, VOCAB).to_dict(), vocab_size=VOCAB,
        temperature=1.0, arch=arch, megatron=MegatronConfig(precision=precision, layer_spec="torch"),
        optimizer=OptimizerConfig(), device=args.device, seed=1, total_optimizer_steps=10,
        global_batch_size=args.rollouts)))
    results = {}
    try:
        lo, hi = args.prompt_length
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, VOCAB - 1, (int(n),), generator=g).tolist()
                   for n in torch.randint(lo, hi + 1, (args.rollouts,), generator=g)]
        group.call("offload_before_refit")
        names = [f"model.layers.{i}." for i in (0, arch.num_layers - 1)]
        weights = {n: t for n, t in group.call("get_hf_weights")[0].items()
                   if any(n.startswith(prefix) for prefix in names)}
        for quant in args.quantization:
            q = None if quant == "none" else quant
            gen = GenerationConfig(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                   batch_size=args.rollouts, ignore_eos=True,
                                   vllm=VLLMConfig(quantization=q, kv_cache_gb=args.kv_cache_gb,
                                                   enforce_eager=args.enforce_eager))
            engine = VLLMGenerationBackend(arch_to_hf_config(arch, VOCAB), gen, eos_token_id=EOS,
                                           pad_token_id=PAD, max_total_length=hi + args.max_new_tokens,
                                           run_dir=tempfile.mkdtemp(prefix=f"vllm_{quant}_"),
                                           device=args.device, colocated=cuda,
                                           dtype="bfloat16" if cuda else "float32")
            try:
                start = time.perf_counter()
                engine.refit(group)
                out = {"refit_s": round(time.perf_counter() - start, 3)}
                out.update(weights_check(engine, weights, [0, arch.num_layers - 1], q))
                engine.generate(prompts[:8], seed=0)  # warm-up
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                batch = engine.generate(prompts, seed=1)
                seconds = time.perf_counter() - start
            finally:
                engine.shutdown()
            tokens = int(batch["response_lengths"].sum())
            out.update(tokens=tokens, seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds))
            batch["prev_logprobs"] = group.gather_rows("get_logprobs", batch, 16)
            out.update({k.removeprefix("train/"): round(v, 5) for k, v in mismatch_figures(batch).items()})
            print(f"{quant}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s; "
                  f"token_mult_prob_error {out['token_mult_prob_error']:.4f}, max gap "
                  f"{out['logprob_mismatch_max']:.3f}; refit {out['refit_s']:.2f} s", flush=True)
            results[quant] = out
    finally:
        group.shutdown()
    print(f"\n{'engine':8s} {'tokens/s':>10s} {'mult_prob_err':>14s} {'max gap':>8s} {'refit s':>8s} "
          f"{'weights':>8s}")
    for quant, out in results.items():
        print(f"{quant:8s} {out['tokens_per_s']:>10,} {out['token_mult_prob_error']:>14.4f} "
              f"{out['logprob_mismatch_max']:>8.3f} {out['refit_s']:>8.2f} "
              f"{'ok' if out['weights_ok'] else 'WRONG':>8s}")
    if "none" in results and "fp8" in results:
        print(f"fp8 / bf16 tokens/s: {results['fp8']['tokens_per_s'] / results['none']['tokens_per_s']:.2f}")
    record = dict(shape=args.shape, rollouts=args.rollouts, max_new_tokens=args.max_new_tokens,
                  device=device, engines=results, failures=FAILURES)
    print("RESULT " + json.dumps(record), flush=True)
    return len(FAILURES)


if __name__ == "__main__":
    sys.exit(main())
