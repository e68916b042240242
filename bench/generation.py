"""Rollout speed of the generation backends (hf, megatron, vllm) on one config's model; prints
one table (and writes it as JSON with ``--json``).

Each backend decodes the same prompts (random token ids of ``--prompt-length``, up to
``--new-tokens`` each) greedily, with the same weights (the policy's seeded initial weights,
refitted from one policy worker), so every backend decodes the same tokens: ``hf`` (a
transformers copy of the weights with our own decoding loop), ``megatron`` (the policy worker
decodes with its own model) and ``vllm`` (one vLLM engine in a process of its own,
``generation.vllm.*`` from the config; on a GPU it shares the policy's GPU, refitted through
CUDA IPC). The time of one ``generate`` call (rows decoded in chunks of
``generation.batch_size``; the median of ``--repeats`` calls after one warm-up call) gives
response tokens per second.

CPU (the numbers in bench/RESULTS.md; the default config, fp32, gloo)::

    python bench/generation.py

GPU (written for a machine with vLLM installed; not run in this repository: the vLLM GPU
wheel cannot be carried to the GPU machines, see README.md)::

    python bench/generation.py --config-name grpo_synthetic_gpu --prompts 1024 \\
        --new-tokens 256 --override generation.batch_size=1024 --override cluster.use_ray=false
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcore_rl.config.loader import load_config  # noqa: E402
from mcore_rl.data.tokenizer import load_tokenizer  # noqa: E402
from mcore_rl.distributed.placement import Placement, config_plan  # noqa: E402
from mcore_rl.distributed.worker_group import DataParallelGroup  # noqa: E402
from mcore_rl.generation.base import BackendContext  # noqa: E402
from mcore_rl.generation.registry import backend_class, build_backend  # noqa: E402
from mcore_rl.megatron.conversion import arch_to_hf_config  # noqa: E402
from mcore_rl.megatron.parallel import resolve_device  # noqa: E402
from mcore_rl.workers.policy import PolicyWorker  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="grpo_synthetic")
    parser.add_argument("--override", action="append", default=[], help="a config override (repeatable)")
    parser.add_argument("--backends", default="hf,megatron,vllm")
    parser.add_argument("--prompts", type=int, default=256, help="rows per generate call")
    parser.add_argument("--prompt-length", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parser.parse_args()

    length = args.prompt_length + args.new_tokens
    cfg = load_config(args.config_name, [
        *args.override, f"generation.max_new_tokens={args.new_tokens}",
        f"data.max_prompt_length={args.prompt_length}", f"data.max_total_length={length}",
        f"model.arch.max_position_embeddings={max(length, 32)}",
        "policy.optimizer.lr_warmup_steps=0"])  # the policy never trains here (1 step's schedule)
    device = resolve_device(cfg.cluster.device)
    tokenizer = load_tokenizer(cfg.model)
    arch = cfg.model.arch
    arch.vocab_size = arch.vocab_size or len(tokenizer)
    hf_config = arch_to_hf_config(arch, arch.vocab_size)
    precision = cfg.policy.megatron.precision
    # One policy worker in this host's processes; on a GPU the vLLM engine shares its GPU.
    cfg.cluster.num_workers, cfg.cluster.use_ray = 1, False
    cfg.cluster.colocate_generation = device == "cuda"
    cfg.run.output_dir = tempfile.mkdtemp(prefix="bench_generation_")
    names = args.backends.split(",")
    own_groups = {}
    for name in names:
        own_groups.update(backend_class(name).worker_groups(cfg))
    placement = Placement(config_plan(cfg.cluster, {"policy": 1}, own_groups), use_ray=False,
                          gpus=device == "cuda")
    policy = DataParallelGroup(placement.make_group("policy", PolicyWorker, dict(
        hf_path=None, hf_config=hf_config.to_dict(), vocab_size=arch.vocab_size,
        temperature=cfg.generation.temperature, arch=arch, megatron=cfg.policy.megatron,
        optimizer=cfg.policy.optimizer, device=device, seed=cfg.run.seed, total_optimizer_steps=1,
        global_batch_size=args.prompts)))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (args.prompts, args.prompt_length), generator=generator)
    prompts = ids.tolist()
    rows = []
    try:
        for name in names:
            cfg.generation.backend = name
            start = time.perf_counter()
            backend = build_backend(BackendContext(
                cfg=cfg, hf_config=hf_config, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, vocab_size=arch.vocab_size, device=device,
                policy=policy, placement=placement))
            if not backend.shares_policy_weights:
                backend.refit(policy)
            ready = time.perf_counter() - start
            seconds = []
            try:  # the engine's process must not outlive an error (the exit would wait for it)
                for i in range(args.repeats + 1):
                    start = time.perf_counter()
                    batch = backend.generate(prompts, seed=i, greedy=True)
                    seconds.append(time.perf_counter() - start)
                    tokens = int(batch["response_lengths"].sum())
            finally:
                backend.shutdown()
            median = statistics.median(seconds[1:])
            rows.append({"backend": name, "start_and_refit_s": round(ready, 2),
                         "generate_s": round(median, 3), "tokens": tokens,
                         "tokens_per_s": round(tokens / median, 1)})
    finally:
        policy.shutdown()
    print(f"{args.config_name}: {args.prompts} prompts x {args.new_tokens} new tokens, {device}, "
          f"{precision}, greedy, generation.batch_size={cfg.generation.batch_size}; median of "
          f"{args.repeats} generate calls after one warm-up")
    print("| backend | start + refit s | generate s | response tokens | tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['backend']} | {r['start_and_refit_s']} | {r['generate_s']} | {r['tokens']} | "
              f"{r['tokens_per_s']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
