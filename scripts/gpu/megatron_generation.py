"""GPU check of the ``megatron`` generation backend (one GPU, bf16, no Ray).

A Qwen2-0.5B-shaped policy (24 layers, hidden 896, 14 heads / 2 KV groups, SwiGLU 4864, tied
embeddings, Qwen2's 151936-token vocabulary; seeded Hugging Face initialisation, no checkpoint)
in one ``PolicyWorker`` process (``ProcessWorkerGroup``, device cuda) decodes ``--rollouts``
random prompts with :class:`~mcore_rl.generation.megatron.MegatronGenerationBackend` after
``offload_before_refit`` (the colocated lifecycle: training state off the GPU, weights kept).
Checks, each printed ``PASS``/``FAIL`` with its numbers (exit code: the number of failures):

1. Sampled-token ``generation_logprobs`` against ``get_logprobs`` on the returned batch (a full
   forward without KV cache): max and mean absolute difference over response tokens within the
   bf16 tolerances ``--max-abs`` / ``--mean-abs``.
2. The same seed gives the same tokens again.
3. After ``offload_after_refit`` generate raises the guard's ``RuntimeError`` naming
   ``prepare_for_lp_inference()`` (not a CUDA error).
4. With ``--eager-check N``: greedy decoding (temperature 0) of the first N prompts with the
   decode steps replayed as CUDA graphs (``generation.cuda_graphs=true``) and decoded eagerly
   (``false``) gives the same tokens, token for token, and the same logprobs.

Also prints decode throughput: generated tokens per second of the timed ``generate`` call (a
short warm-up call first), the same for the ``hf`` backend on the same weights and prompts (for
comparison, not checked; ``--skip-hf`` leaves it out), with ``--vllm`` the same for a vLLM engine
(``generation.backend=vllm``, colocated: one engine process on the same GPU, refit from the
policy over CUDA IPC: mcore-rl's configuration, a request per row with its own seed and the
sampled tokens' logprobs), with ``--vllm-best`` vLLM at its own best (issue 37: a plain
``vllm.LLM`` in a process of its own, dummy weights of the same shape, CUDA graphs, prefix
caching, its default sampler, FlashInfer's sampler where FlashInfer is installed, no per-row
seeds), timed in three sampling configurations on one engine: per-row seeds with logprobs
(mcore-rl's), no seeds with logprobs (what RL needs), no seeds without logprobs (plain
serving); the megatron-core and torch versions, and
last a one-line JSON record of the figures (``RESULT {...}``). ``--ignore-eos``: every row
decodes its whole budget in every backend (the same tokens to make, whatever the weights);
``--compile-decode`` and ``--shared-prompt-kv`` set those ``generation`` keys for the megatron
backend (with ``--generations G`` rows per prompt, adjacent, for the shared prompts). The script runs on a checkout
without ``generation.cuda_graphs`` too (the code before CUDA-graph decoding), without
``--eager-check``: that is how the before/after figures of bench/RESULTS.md were taken in one call
(scripts/gpu/decode_bench.py).

    python3 scripts/gpu/megatron_generation.py [--layer-spec torch] [--rollouts 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.config.schema import (  # noqa: E402
    GenerationConfig, MegatronConfig, ModelArchConfig, OptimizerConfig)
from mcore_rl.distributed.worker_group import (DataParallelGroup, ProcessWorkerGroup,  # noqa: E402
                                              WorkerError)
from mcore_rl.generation.hf import HFGenerationBackend  # noqa: E402
from mcore_rl.generation.megatron import MegatronGenerationBackend  # noqa: E402
from mcore_rl.megatron.conversion import arch_to_hf_config  # noqa: E402
from mcore_rl.workers.policy import PolicyWorker  # noqa: E402
from passfail import FAILURES, check  # noqa: E402

VOCAB = 151936
ARCH = ModelArchConfig(family="qwen2", num_layers=24, hidden_size=896, num_attention_heads=14,
                       num_query_groups=2, ffn_hidden_size=4864, max_position_embeddings=32768,
                       rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True,
                       vocab_size=VOCAB)
EOS, PAD = VOCAB - 1, 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layer-spec", default="torch", choices=["torch", "local"])
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--prompt-length", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64, help="generation.batch_size")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-abs", type=float, default=0.25, help="bf16 tolerance, max |diff|")
    p.add_argument("--mean-abs", type=float, default=0.02, help="bf16 tolerance, mean |diff|")
    p.add_argument("--skip-hf", action="store_true", help="no hf backend comparison")
    p.add_argument("--vllm", action="store_true", help="also a vLLM engine on the same GPU")
    p.add_argument("--vllm-best", action="store_true",
                   help="also vLLM at its own best configuration (no per-row seeds, CUDA graphs, "
                        "prefix caching, its default sampler)")
    p.add_argument("--ignore-eos", action="store_true", help="generation.ignore_eos everywhere")
    p.add_argument("--compile-decode", action="store_true", help="generation.compile_decode")
    p.add_argument("--shared-prompt-kv", action="store_true",
                   help="generation.shared_prompt_kv")
    p.add_argument("--generations", type=int, default=1,
                   help="rows per prompt (adjacent: GRPO's groups)")
    p.add_argument("--eager-check", type=int, default=0, metavar="N",
                   help="greedy CUDA-graph vs eager decoding of the first N prompts (check 4)")
    args = p.parse_args()
    result = {"rollouts": args.rollouts, "batch_size": args.batch_size,
              "max_new_tokens": args.max_new_tokens}

    import megatron.core

    print(f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    group = DataParallelGroup(ProcessWorkerGroup(PolicyWorker, 1, dict(
        hf_path=None, hf_config=arch_to_hf_config(ARCH, VOCAB).to_dict(), vocab_size=VOCAB,
        temperature=args.temperature, arch=ARCH,
        megatron=MegatronConfig(precision="bf16", layer_spec=args.layer_spec),
        optimizer=OptimizerConfig(), device="cuda", seed=1, total_optimizer_steps=10,
        global_batch_size=args.rollouts)))
    try:
        gen = GenerationConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                               batch_size=args.batch_size, ignore_eos=args.ignore_eos)
        if args.compile_decode or args.shared_prompt_kv:  # keys the code before issue 37 lacks
            gen = dataclasses.replace(gen, compile_decode=args.compile_decode,
                                      shared_prompt_kv=args.shared_prompt_kv)
        lo, hi = args.prompt_length
        backend = MegatronGenerationBackend(group, gen, eos_token_id=EOS, pad_token_id=PAD,
                                            max_total_length=hi + args.max_new_tokens,
                                            vocab_size=VOCAB)
        g = torch.Generator().manual_seed(0)
        distinct = -(-args.rollouts // args.generations)
        prompts = [q for n in torch.randint(lo, hi + 1, (distinct,), generator=g)
                   for q in [torch.randint(1, VOCAB - 1, (int(n),), generator=g).tolist()]
                   for _ in range(args.generations)][:args.rollouts]
        group.call("offload_before_refit")
        backend.generate(prompts[:4], seed=0)  # warm-up
        start = time.perf_counter()
        batch = backend.generate(prompts, seed=1)
        seconds = time.perf_counter() - start
        tokens = int(batch["response_lengths"].sum())
        print(f"decode: {args.rollouts} rollouts, {tokens} response tokens in {seconds:.2f} s: "
              f"{tokens / seconds:.0f} tokens/s ({args.layer_spec} spec, batch_size "
              f"{args.batch_size}, compile_decode={args.compile_decode}, shared_prompt_kv="
              f"{args.shared_prompt_kv})", flush=True)
        result.update(tokens=tokens, seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds))

        logprobs = group.gather_rows("get_logprobs", batch, 8)
        mask = batch["token_mask"].bool()
        diff = (logprobs - batch["generation_logprobs"]).abs()[mask]
        check("sampled-token generation_logprobs vs get_logprobs (bf16)",
              bool(diff.max() <= args.max_abs and diff.mean() <= args.mean_abs),
              f"max |diff| {diff.max():.4f} (<= {args.max_abs}), mean {diff.mean():.5f} "
              f"(<= {args.mean_abs}) over {int(mask.sum())} tokens; logprob mean "
              f"{float(logprobs[mask].mean()):.3f}")
        again = backend.generate(prompts, seed=1)
        same = torch.equal(again["input_ids"], batch["input_ids"])
        differ = (again["input_ids"] != batch["input_ids"]).any(dim=1).sum()
        check("same seed, same rollouts", same, f"{int(differ)} of {args.rollouts} rows differ")
        result.update(max_abs=round(float(diff.max()), 4), mean_abs=round(float(diff.mean()), 5),
                      same_seed=bool(same))

        if args.eager_check:
            subset = prompts[:args.eager_check]
            greedy = {graphs: MegatronGenerationBackend(
                group, dataclasses.replace(gen, cuda_graphs=graphs), eos_token_id=EOS,
                pad_token_id=PAD, max_total_length=hi + args.max_new_tokens,
                vocab_size=VOCAB).generate(subset, seed=0, greedy=True) for graphs in (True, False)}
            graph_run, eager_run = greedy[True], greedy[False]
            same_shape = graph_run["input_ids"].shape == eager_run["input_ids"].shape
            rows = int((graph_run["input_ids"] != eager_run["input_ids"]).any(dim=1).sum()) \
                if same_shape else len(subset)
            lp = float((graph_run["generation_logprobs"] - eager_run["generation_logprobs"])
                       .abs().max()) if rows == 0 else float("nan")
            n = int(graph_run["response_lengths"].sum())
            check("greedy decoding, CUDA graphs vs eager: same tokens", rows == 0,
                  f"{rows} of {len(subset)} rows differ over {n} tokens; logprobs max |diff| {lp:.3g}")
            result.update(eager_rows_differ=rows, eager_logprob_diff=lp)

        if args.vllm:
            result.update(vllm_tokens_per_s=_vllm_throughput(group, gen, prompts, hi + args.max_new_tokens))
        if args.vllm_best:
            result.update(vllm_best=_vllm_best(gen, prompts, hi + args.max_new_tokens))
        # The hf backend on the same weights: its throughput, for comparison.
        if args.skip_hf:
            return _finish(group, backend, prompts, result)
        hf = HFGenerationBackend(arch_to_hf_config(ARCH, VOCAB), gen, eos_token_id=EOS,
                                 pad_token_id=PAD, max_total_length=hi + args.max_new_tokens,
                                 device="cuda", dtype=torch.bfloat16)
        hf.refit(group)
        hf.generate(prompts[:4], seed=0)  # warm-up
        start = time.perf_counter()
        hf_tokens = int(hf.generate(prompts, seed=1)["response_lengths"].sum())
        hf_seconds = time.perf_counter() - start
        print(f"hf backend, same weights and prompts: {hf_tokens} response tokens in "
              f"{hf_seconds:.2f} s: {hf_tokens / hf_seconds:.0f} tokens/s", flush=True)
        result.update(hf_tokens_per_s=round(hf_tokens / hf_seconds))
        del hf
        return _finish(group, backend, prompts, result)
    finally:
        group.shutdown()


def _vllm_throughput(group, gen: GenerationConfig, prompts, max_total_length: int) -> int:
    """Tokens/s of one timed ``generate`` of ``prompts`` by a vLLM engine (its own process on
    this GPU, refit from ``group`` over CUDA IPC, a short warm-up call first); the engine is
    shut down after."""
    import tempfile

    from mcore_rl.generation.vllm import VLLMGenerationBackend

    engine = VLLMGenerationBackend(arch_to_hf_config(ARCH, VOCAB), gen, eos_token_id=EOS,
                                   pad_token_id=PAD, max_total_length=max_total_length,
                                   run_dir=tempfile.mkdtemp(prefix="vllm_decode_"), device="cuda",
                                   dtype="bfloat16", colocated=True)
    try:
        start = time.perf_counter()
        engine.refit(group)
        refit = time.perf_counter() - start
        engine.generate(prompts[:4], seed=0)  # warm-up
        start = time.perf_counter()
        tokens = int(engine.generate(prompts, seed=1)["response_lengths"].sum())
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    print(f"vllm backend, same weights and prompts: {tokens} response tokens in {seconds:.2f} s: "
          f"{tokens / seconds:.0f} tokens/s (refit over CUDA IPC {refit:.2f} s)", flush=True)
    return round(tokens / seconds)


def _vllm_best(gen: GenerationConfig, prompts, max_total_length: int) -> dict:
    """vLLM at its own best (``--vllm-best``), in a process of its own: ``{configuration:
    tokens/s}`` for per-row seeds with logprobs (mcore-rl's requests), no seeds with logprobs,
    no seeds without logprobs; with ``sampler``: FlashInfer's or vLLM's torch sampler."""
    import multiprocessing
    import tempfile

    model_dir = tempfile.mkdtemp(prefix="vllm_best_")
    arch_to_hf_config(ARCH, VOCAB).save_pretrained(model_dir)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_vllm_configs, args=(model_dir, gen, prompts, max_total_length,
                                                   queue))
    proc.start()
    try:
        out = queue.get(timeout=900)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    if isinstance(out, str):
        print(f"vllm best: failed: {out}", flush=True)
        return {"error": out}
    for name, value in out.items():
        if name != "sampler":
            print(f"vllm best ({out['sampler']} sampler, CUDA graphs, prefix caching), {name}: "
                  f"{value['tokens']} response tokens in {value['seconds']:.2f} s: "
                  f"{value['tokens_per_s']} tokens/s", flush=True)
    return out


def _vllm_configs(model_dir: str, gen: GenerationConfig, prompts, max_total_length: int,
                  queue) -> None:
    """In its own process: one ``vllm.LLM`` (dummy weights of the model's shape, bf16, CUDA
    graphs, prefix caching, ``max_num_seqs`` = the rows), each sampling configuration timed
    after a warm-up call; the figures (or the error's text) put on ``queue``."""
    import importlib.util

    from mcore_rl.generation.sampling import row_seed

    try:
        flashinfer = importlib.util.find_spec("flashinfer") is not None
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "1" if flashinfer else "0"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                  seed=0, max_model_len=max_total_length, max_num_seqs=len(prompts),
                  enable_prefix_caching=True, gpu_memory_utilization=0.6,
                  generation_config="vllm")
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        common = dict(max_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
                      ignore_eos=gen.ignore_eos, detokenize=False)
        if not gen.ignore_eos:
            common["stop_token_ids"] = [EOS]
        configs = {
            "per-row seeds, logprobs": [SamplingParams(seed=row_seed(1, r), logprobs=0, **common)
                                        for r in range(len(prompts))],
            "no seeds, logprobs": SamplingParams(logprobs=0, **common),
            "no seeds, no logprobs": SamplingParams(**common),
        }
        out = {"sampler": "FlashInfer" if flashinfer else "torch"}
        for name, params in configs.items():
            warm = params[:4] if isinstance(params, list) else params
            llm.generate(requests[:4], warm, use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate(requests, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            out[name] = {"tokens": tokens, "seconds": round(seconds, 3),
                         "tokens_per_s": round(tokens / seconds)}
        queue.put(out)
    except Exception as e:  # noqa: BLE001 (reported, the other figures stand)
        queue.put(f"{type(e).__name__}: {e}"[:500])


def _finish(group, backend, prompts, result) -> int:
    """Check 3 (the offload guard); prints the ``RESULT`` record; returns the failure count."""
    group.call("offload_after_refit")
    try:
        backend.generate(prompts[:2], seed=0)
        kind = "no error"
    except WorkerError as e:
        kind = str(e)
    check("offloaded weights: generate raises the guard's RuntimeError",
          "RuntimeError: generate:" in kind and "prepare_for_lp_inference()" in kind,
          kind.strip().splitlines()[-1][:160])
    result["failures"] = list(FAILURES)
    print("RESULT " + json.dumps(result), flush=True)
    return len(FAILURES)


if __name__ == "__main__":
    sys.exit(main())
