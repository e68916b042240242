#!/usr/bin/env python
"""Policy layout parity on GPUs: each TP x PP x DP layout against one GPU, in production settings.

Settings: NCCL, bf16 params with fp32 main params and fp32 gradient reduction, Megatron's
distributed optimizer, ``overlap_grad_reduce`` and ``overlap_param_gather`` on. For every
layout (default (TP,PP,DP) = (2,1,1), (1,2,1), (1,1,2), (2,2,1); needs TP x PP x DP GPUs, 4 for
the default set) the policy is built from the same seeded Hugging Face initialisation, runs the
same steps on the same global batch as a one-GPU reference, and
:mod:`mcore_rl.controller.parity` (shared with ``tests/test_layouts.py``) compares per-token
logprobs, loss, grad norm and every weight after the steps. Prints a table of the differences
and exits 1 when one is over its bf16 tolerance:

- logprobs, loss: relative (to the reference's largest magnitude) ``--rel-tol`` (2e-2): bf16
  keeps 8 significant bits, so a GEMM reduced in another order (TP) moves a logit by about
  one bf16 ulp (2^-8 relative);
- grad norm: ``--grad-norm-tol`` (5e-2): it sums squares of such gradients;
- weights: ``2 x lr x steps`` (Adam moves a weight by about ``lr`` per step whatever the size
  of its gradient, so a round-off gradient can flip sign between layouts) plus one bf16
  rounding step of the largest weight (``2^-8 max|w|``).

The model is a Qwen2-shaped decoder with tied embeddings (PP's copy of the embedding on the
last stage) and an odd vocabulary (padded for TP); sizes are options. ``--preset llama8b`` is
the Llama-3.1-8B shape (untied, vocabulary 128256) with ``--init normal`` (each tensor drawn on
the GPU from its own seed, ``model.init=normal``: no 8B model is built on the host) and, since
one GPU cannot train it, a reference layout of several GPUs (``--reference 2,1,2``).

Usage (repository installed, ``pip install -e .``), on a machine with 4 GPUs::

    python scripts/gpu/layout_parity.py
    python scripts/gpu/layout_parity.py --layouts 2,1,1 2,2,1 --steps 2
    python scripts/gpu/layout_parity.py --preset llama8b --reference 2,1,2 --layouts 4,1,1 \
        --layer-spec torch --rows 16 --max-length 1024
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import List, Optional, Tuple

import torch

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.schema import DDPConfig, LossConfig, MegatronConfig, ModelArchConfig, OptimizerConfig
from mcore_rl.controller import parity
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import DataParallelGroup, ProcessWorkerGroup
from mcore_rl.megatron.conversion import arch_to_hf_config
from mcore_rl.workers.interfaces import PolicyAPI
from mcore_rl.workers.policy import PolicyWorker

DEFAULT_LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)]


def parse_layout(text: str) -> Tuple[int, int, int]:
    """``"TP,PP,DP"`` -> ``(tp, pp, dp)``; raises ``argparse.ArgumentTypeError`` otherwise."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"a layout is TP,PP,DP with positive integers, got {text!r}")
    return tuple(int(p) for p in parts)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", type=parse_layout, default=DEFAULT_LAYOUTS,
                   metavar="TP,PP,DP", help="layouts to check (default: 2,1,1 1,2,1 1,1,2 2,2,1)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps before the weights are compared")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--layer-spec", default="local", choices=("local", "torch"))
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--ffn-hidden-size", type=int, default=1408)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--query-groups", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=32003, help="odd: padded under TP")
    p.add_argument("--rows", type=int, default=32, help="sequences in the global batch")
    p.add_argument("--max-length", type=int, default=256, help="longest sequence (tokens)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rel-tol", type=float, default=2e-2, help="logprobs and loss")
    p.add_argument("--grad-norm-tol", type=float, default=5e-2)
    p.add_argument("--preset", choices=("llama8b",), default=None,
                   help="a model shape replacing the size options (module docstring)")
    p.add_argument("--init", choices=("transformers", "normal"), default="transformers",
                   help="the seeded random start (model.init)")
    p.add_argument("--reference", type=parse_layout, default=(1, 1, 1), metavar="TP,PP,DP",
                   help="the layout the others are compared with (default 1,1,1: one GPU)")
    args = p.parse_args(argv)
    if args.preset == "llama8b":
        args.num_layers, args.hidden_size, args.ffn_hidden_size = 32, 4096, 14336
        args.heads, args.query_groups, args.vocab_size = 32, 8, 128256
        args.init = "normal"
    return args


def _arch(args) -> ModelArchConfig:
    if args.preset == "llama8b":
        return ModelArchConfig(family="llama", num_layers=32, hidden_size=4096,
                               num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                               max_position_embeddings=131072, rope_theta=500000.0,
                               rope_scaling_factor=8.0, rms_norm_eps=1e-5, qkv_bias=False,
                               tie_word_embeddings=False, vocab_size=128256)
    return ModelArchConfig(family="qwen2", num_layers=args.num_layers, hidden_size=args.hidden_size,
                           num_attention_heads=args.heads, num_query_groups=args.query_groups,
                           ffn_hidden_size=args.ffn_hidden_size,
                           max_position_embeddings=max(args.max_length, 128), qkv_bias=True,
                           tie_word_embeddings=True, vocab_size=args.vocab_size)


def worker_kwargs(args, tp: int, pp: int) -> dict:
    """PolicyWorker arguments of one layout (the DP size follows from the world size)."""
    arch = _arch(args)
    megatron = MegatronConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        precision=args.precision, layer_spec=args.layer_spec,
        ddp=DDPConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True,
                      use_distributed_optimizer=True, overlap_param_gather=True))
    return dict(hf_path=None, hf_config=arch_to_hf_config(arch, args.vocab_size).to_dict(),
                vocab_size=args.vocab_size, temperature=1.0, use_reference=False, init=args.init,
                arch=arch,
                megatron=megatron, optimizer=OptimizerConfig(lr=args.lr, clip_grad=1.0),
                device="cuda", seed=args.seed, total_optimizer_steps=args.steps,
                global_batch_size=args.rows)


def make_batch(args) -> B.Batch:
    """A seeded right-padded rollout batch with the keys of :class:`ClippedPGLoss` (KL on)."""
    g = torch.Generator().manual_seed(args.seed)
    n, width, vocab = args.rows, args.max_length, args.vocab_size
    lengths = torch.randint(width // 4, width + 1, (n,), generator=g)
    prompts = (lengths // 3).clamp(min=1)
    ids = torch.randint(0, vocab, (n, width), generator=g)
    cols = torch.arange(width)[None, :]
    mask = ((cols >= prompts[:, None]) & (cols < lengths[:, None])).float()
    ids = ids * (cols < lengths[:, None])
    near = -math.log(vocab) + 0.3 * torch.randn(2, n, width, generator=g)
    return {"input_ids": ids, "input_lengths": lengths, "prompt_lengths": prompts,
            "token_mask": mask, "sample_mask": torch.ones(n),
            "advantages": torch.randn(n, 1, generator=g) * mask,
            "prev_logprobs": near[0] * mask, "reference_logprobs": near[1] * mask}


def run_layout(args, tp: int, pp: int, dp: int, batch: B.Batch, loss) -> parity.StepRecord:
    """``args.steps`` steps on ``tp x pp x dp`` GPUs; the record of the first step's logprobs
    and metrics with the weights after the last step."""
    group = ProcessWorkerGroup(PolicyWorker, tp * pp * dp, worker_kwargs(args, tp, pp))
    try:
        dp_group = DataParallelGroup(group)
        mbs = args.micro_batch_size
        record = parity.record_step(dp_group, batch, loss, mbs, mbs)
        for _ in range(args.steps - 1):
            dp_group.train(batch, loss, mbs)
        if args.steps > 1:
            record.weights = group.call(PolicyAPI).get_hf_weights()[0]
        return record
    finally:
        group.shutdown()


def main(argv: Optional[List[str]] = None) -> int:
    """Run the reference and every layout, print the table; 0 when all are within tolerance."""
    args = parse_args(argv)
    need = max(tp * pp * dp for tp, pp, dp in args.layouts + [args.reference])
    if torch.cuda.device_count() < need:
        print(f"needs {need} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    batch, loss = make_batch(args), ClippedPGLoss(LossConfig(kl_coef=0.05))
    reference = run_layout(args, *args.reference, batch, loss)
    largest = max(w.abs().max().item() for w in reference.weights.values())
    params_tol = 2 * args.lr * args.steps + 2.0 ** -8 * largest
    tolerances = {"logprobs_rel": args.rel_tol, "loss_rel": args.rel_tol,
                  "grad_norm_rel": args.grad_norm_tol, "params_max_abs": params_tol}
    rows, failed = {}, []
    for tp, pp, dp in args.layouts:
        name = f"TP{tp} PP{pp} DP{dp}"
        rows[name] = parity.compare(run_layout(args, tp, pp, dp, batch, loss), reference)
        failed += [f"{name}: {k} = {rows[name][k]:.2e} > {tol:.2e}"
                   for k, tol in tolerances.items() if not rows[name][k] <= tol]
    print(f"{args.precision}, distributed optimizer, overlap_grad_reduce, overlap_param_gather; "
          f"{args.rows} rows up to {args.max_length} tokens, {args.steps} step(s), lr {args.lr}; "
          f"reference: TP{args.reference[0]} PP{args.reference[1]} DP{args.reference[2]} "
          f"(loss {reference.metrics['loss']:.5f}, grad norm "
          f"{reference.metrics['grad_norm']:.5f})")
    print(parity.parity_table({**rows, "tolerance": tolerances}))
    for line in failed:
        print("FAIL", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
