#!/usr/bin/env python
"""Expert parallelism on GPUs: a Qwen3-MoE-shaped policy at EP=2 against EP=1, bf16.

Both layouts run on the same 2 GPUs (EP=1: each GPU holds every expert, DP=2; EP=2: each GPU
holds half the experts of every layer, DP=2 for attention and embeddings), NCCL, the alltoall
token dispatcher, bf16 params with fp32 main params, Adam, the router load-balancing loss on.
Each layout is built from the same seeded Hugging Face initialisation and computes, on the same
global batch:

- the per-token logprobs (compared: ``max|EP2 - EP1| / max|EP1|``, bf16 tolerance
  ``--rel-tol``, as in ``layout_parity.py``: a GEMM reduced in another order moves a logit by
  about one bf16 ulp);
- one optimizer step: loss and grad norm (compared the same way; the grad norm sums squares);
- then the throughput of ``--repeats`` logprob passes and train steps (tokens/s over the real,
  non-padding tokens of the batch; CUDA work is finished when a call returns, since the
  workers hand back CPU tensors).

Prints the parity and the throughput table and exits 1 when a difference is over its
tolerance. The default model has 4 layers of Qwen3-30B-A3B's shape (hidden 2048, 32 query and
4 key/value heads of 128, query/key RMSNorm, 128 experts of width 768, top-8 renormalized, no
shared expert) and its 151,936-token vocabulary: 3.1B parameters (2.4B of them experts).

Usage (repository installed, or on PYTHONPATH), on a machine with 2 GPUs::

    python scripts/gpu/moe_parity.py
    python scripts/gpu/moe_parity.py --device cpu --precision fp32 --preset tiny   # smoke test
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Dict, List, Optional

import torch

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.schema import LossConfig, MegatronConfig, ModelArchConfig, OptimizerConfig
from mcore_rl.controller import parity
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import DataParallelGroup, ProcessWorkerGroup
from mcore_rl.megatron.conversion import arch_to_hf_config
from mcore_rl.workers.interfaces import PolicyAPI
from mcore_rl.workers.policy import PolicyWorker

# (layers, hidden, heads, query groups, head_dim, experts, top-k, expert ffn, vocab,
#  rows, max length, micro-batch)
PRESETS = {
    "qwen3_moe": (4, 2048, 32, 4, 128, 128, 8, 768, 151936, 32, 512, 4),
    "tiny": (2, 64, 4, 2, 32, 4, 2, 32, 101, 8, 32, 2),
}
WORLD = 2


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3_moe", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--layer-spec", default="torch", choices=("local", "torch"))
    p.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    p.add_argument("--aux-loss-coeff", type=float, default=1e-3)
    p.add_argument("--repeats", type=int, default=3, help="timed logprob passes and train steps")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rel-tol", type=float, default=2e-2, help="logprobs and loss")
    p.add_argument("--grad-norm-tol", type=float, default=5e-2)
    return p.parse_args(argv)


def _arch(args) -> ModelArchConfig:
    layers, hidden, heads, groups, head_dim, experts, topk, expert_ffn, vocab, *_ = PRESETS[args.preset]
    return ModelArchConfig(family="qwen3_moe", num_layers=layers, hidden_size=hidden,
                           num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim,
                           ffn_hidden_size=expert_ffn, max_position_embeddings=4096,
                           rope_theta=1e6, qkv_bias=False, tie_word_embeddings=False,
                           vocab_size=vocab, num_experts=experts, moe_router_topk=topk,
                           moe_ffn_hidden_size=expert_ffn, moe_norm_topk_prob=True)


def make_batch(args) -> B.Batch:
    """A seeded right-padded rollout batch with the keys of :class:`ClippedPGLoss`."""
    *_, vocab, n, width, _ = PRESETS[args.preset]
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(width // 2, width + 1, (n,), generator=g)
    prompts = (lengths // 3).clamp(min=1)
    cols = torch.arange(width)[None, :]
    ids = torch.randint(0, vocab, (n, width), generator=g) * (cols < lengths[:, None])
    mask = ((cols >= prompts[:, None]) & (cols < lengths[:, None])).float()
    old = -math.log(vocab) + 0.3 * torch.randn(n, width, generator=g)
    return {"input_ids": ids, "input_lengths": lengths, "prompt_lengths": prompts,
            "token_mask": mask, "sample_mask": torch.ones(n),
            "advantages": torch.randn(n, 1, generator=g) * mask, "prev_logprobs": old * mask}


def run_layout(args, ep: int, batch: B.Batch, loss) -> Dict[str, object]:
    """Logprobs and one train step at EP=``ep`` on :data:`WORLD` processes, then the timings."""
    arch, micro_batch = _arch(args), PRESETS[args.preset][-1]
    megatron = MegatronConfig(precision=args.precision, layer_spec=args.layer_spec,
                              expert_model_parallel_size=ep, moe_token_dispatcher_type=args.dispatcher,
                              moe_aux_loss_coeff=args.aux_loss_coeff)
    kwargs = dict(hf_path=None, hf_config=arch_to_hf_config(arch, arch.vocab_size).to_dict(),
                  vocab_size=arch.vocab_size, arch=arch, megatron=megatron,
                  optimizer=OptimizerConfig(lr=args.lr, clip_grad=1.0), device=args.device,
                  seed=args.seed, total_optimizer_steps=args.repeats + 1,
                  global_batch_size=batch["input_ids"].shape[0])
    group = ProcessWorkerGroup(PolicyWorker, WORLD, kwargs)
    try:
        dp = DataParallelGroup(group)
        logprobs = dp.gather_rows(PolicyAPI).get_logprobs(batch, micro_batch)
        metrics = dp.train(batch, loss, micro_batch)
        tokens = batch["input_lengths"].sum().item() * args.repeats
        start = time.perf_counter()
        for _ in range(args.repeats):
            dp.gather_rows(PolicyAPI).get_logprobs(batch, micro_batch)
        logprob_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(args.repeats):
            dp.train(batch, loss, micro_batch)
        train_s = time.perf_counter() - start
        return {"record": parity.StepRecord(logprobs, metrics, {}),
                "logprob_tok_s": tokens / logprob_s, "train_tok_s": tokens / train_s,
                "train_step_s": train_s / args.repeats}
    finally:
        group.shutdown()


def main(argv: Optional[List[str]] = None) -> int:
    """Run EP=1 then EP=2, print the tables; 0 when the differences are within tolerance."""
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    batch, loss = make_batch(args), ClippedPGLoss(LossConfig())
    runs = {ep: run_layout(args, ep, batch, loss) for ep in (1, 2)}
    ref, ep2 = runs[1]["record"], runs[2]["record"]
    mask = batch["token_mask"].bool()
    diffs = {"logprobs_rel": parity.relative_diff(ep2.logprobs[mask], ref.logprobs[mask]),
             "loss_rel": parity.relative_diff(ep2.metrics["loss"], ref.metrics["loss"]),
             "grad_norm_rel": parity.relative_diff(ep2.metrics["grad_norm"],
                                                   ref.metrics["grad_norm"])}
    tolerances = {"logprobs_rel": args.rel_tol, "loss_rel": args.rel_tol,
                  "grad_norm_rel": args.grad_norm_tol}
    arch = _arch(args)
    rows, width = batch["input_ids"].shape
    print(f"{args.preset}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
          f"{arch.num_experts} experts top-{arch.moe_router_topk} (ffn {arch.moe_ffn_hidden_size}), "
          f"vocab {arch.vocab_size}; {args.precision}, {args.layer_spec} spec, {args.dispatcher} "
          f"dispatcher, aux loss {args.aux_loss_coeff}; {rows} rows up to {width} tokens "
          f"({batch['input_lengths'].sum().item()} tokens), {WORLD} {args.device} processes")
    print(f"EP=1: loss {ref.metrics['loss']:.6f}, grad norm {ref.metrics['grad_norm']:.6f}; "
          f"EP=2: loss {ep2.metrics['loss']:.6f}, grad norm {ep2.metrics['grad_norm']:.6f}")
    print("| diff EP=2 vs EP=1 | value | tolerance |\n| --- | --- | --- |")
    for key, value in diffs.items():
        print(f"| {key} | {value:.2e} | {tolerances[key]:.0e} |")
    print("\n| layout | logprobs tokens/s | train tokens/s | train step s |\n| --- | --- | --- | --- |")
    for ep, run in runs.items():
        print(f"| EP={ep} x DP=2 | {run['logprob_tok_s']:,.0f} | {run['train_tok_s']:,.0f} | "
              f"{run['train_step_s']:.3f} |")
    failed = [key for key, tol in tolerances.items() if not diffs[key] <= tol]
    for key in failed:
        print(f"FAIL {key} = {diffs[key]:.2e} > {tolerances[key]:.0e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
