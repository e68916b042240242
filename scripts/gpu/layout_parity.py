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

Layer specs and context parallelism (issue 34): a layout is ``TP,PP,DP[,CP][:SPEC]`` (CP default
1; SPEC default ``--layer-spec``), so one run compares specs on the same weights and batch
(``--reference 1,1,1:torch --layouts 1,1,1:transformer_engine 1,1,1:local``) or CP against one
GPU (``--reference 1,1,1:torch --layouts 1,1,1,2:torch``; the ``torch`` spec's CP all-gathers
keys and values, ``cp_comm_type=all_gather``; the ``transformer_engine`` spec's runs TE's
``p2p`` ring). SPEC ``fp8-RECIPE`` (``fp8-delayed``, ``fp8-tensorwise``, ``fp8-blockwise``) is
the ``transformer_engine`` spec with ``fp8=hybrid`` and that recipe, ``fp8-RECIPE-bf16ends``
(not delayed) the same with the first and the last layer in bf16 (``fp8_bf16_layers_at_start``
and ``_at_end`` 1): reported in the table, not held to the bf16 tolerances. ``--config NAME [--set key=value ...]`` takes the model shape (and,
with ``model.hf_path``, the weights) from a training config, e.g. SmolLM2-135M-Instruct:
``--config grpo_smollm2_arith --set model.hf_path=/tmp/models/SmolLM2-135M-Instruct``, or the
0.36B shape of ``--config grpo_synthetic_gpu`` (seeded random weights). Besides the relative
differences the table has the largest and the mean absolute logprob difference (over the
positions 1 .. length - 1 of each row) and the mean absolute weight difference; the reference's
and every row's loss and grad norm follow it.

Packed micro-batches (``policy.sequence_packing``): a layout ending in ``:packed``
(``TP,PP,DP[,CP][:SPEC]:packed``) runs its workers with ``sequence_packing`` (THD rows under a
token budget, ``--max-tokens-per-microbatch``, default the worker's ``micro_batch_size`` x the
longest row; with CP every sequence padded to ``2 CP`` and split per sequence as Transformer
Engine's ``thd_get_partitioned_indices``). The script builds the workers itself, so it runs
what the config loader refuses (packed CP on the ``transformer_engine`` spec with a2a or
all_gather: ``rules.context_parallel_errors``; p2p was lifted on this script's evidence) to give
the evidence for lifting it. ``--reference`` takes
several layouts: every layout is compared with every reference (rows ``LAYOUT vs
REFERENCE``), e.g. packed CP=2 against padded and packed CP=1 in one run::

    --reference 1,1,1:transformer_engine 1,1,1:transformer_engine:packed \
        --layouts 1,1,1,2:transformer_engine 1,1,1,2:transformer_engine:packed

``--device cpu`` (gloo, ``--precision fp32``, no distributed optimizer or overlap) runs the same
code with the ``torch`` and ``local`` specs: ``tests/test_layouts.py`` runs it on a tiny shape,
packed CP=2 against padded and packed CP=1 included.

Usage (repository installed, ``pip install -e .``), on a machine with 4 GPUs::

    python scripts/gpu/layout_parity.py
    python scripts/gpu/layout_parity.py --layouts 2,1,1 2,2,1 --steps 2
    python scripts/gpu/layout_parity.py --preset llama8b --reference 2,1,2 --layouts 4,1,1 \
        --layer-spec torch --rows 16 --max-length 1024
    python scripts/gpu/layout_parity.py --config grpo_smollm2_arith \
        --set model.hf_path=/tmp/models/SmolLM2-135M-Instruct --reference 1,1,1:torch \
        --layouts 1,1,1:transformer_engine 1,1,1:local 1,1,1:fp8-delayed --lr 5e-6
    python scripts/gpu/layout_parity.py --reference 1,1,1:transformer_engine \
        --layouts 1,1,1,2:transformer_engine --steps 2          # 2 GPUs
    python scripts/gpu/layout_parity.py --steps 2 --rows 16 --max-length 2048 \
        --reference 1,1,1:torch 1,1,1:torch:packed --layouts 1,1,1,2:torch:packed   # 2 GPUs
    python scripts/gpu/layout_parity.py --device cpu --precision fp32 --num-layers 2 \
        --hidden-size 32 --ffn-hidden-size 64 --heads 4 --query-groups 2 --vocab-size 47 \
        --rows 8 --max-length 16 --reference 1,1,1:torch --layouts 1,1,1:local 1,1,1,2:torch
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.schema import (DDPConfig, FP8_RECIPES, LAYER_SPECS, LossConfig, MegatronConfig,
                                    ModelArchConfig, OptimizerConfig)
from mcore_rl.controller import parity
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import DataParallelGroup, ProcessWorkerGroup
from mcore_rl.megatron.conversion import arch_to_hf_config
from mcore_rl.megatron.te import te_environment
from mcore_rl.workers.interfaces import PolicyAPI
from mcore_rl.workers.policy import PolicyWorker

@dataclass(frozen=True)
class Layout:
    """One run: TP x PP x DP x CP processes of one layer spec (None: ``--layer-spec``); with
    ``fp8_recipe`` the ``transformer_engine`` spec in FP8 (``fp8=hybrid``); ``packed``:
    sequence packing (THD micro-batches)."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    spec: Optional[str] = None
    fp8_recipe: Optional[str] = None
    packed: bool = False
    bf16_ends: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def name(self, default_spec: str) -> str:
        cp = f" CP{self.cp}" if self.cp > 1 else ""
        spec = (f"fp8-{self.fp8_recipe}{'-bf16ends' if self.bf16_ends else ''}"
                if self.fp8_recipe else (self.spec or default_spec))
        return f"TP{self.tp} PP{self.pp} DP{self.dp}{cp} {spec}{' packed' if self.packed else ''}"


DEFAULT_LAYOUTS = [Layout(2, 1, 1), Layout(1, 2, 1), Layout(1, 1, 2), Layout(2, 2, 1)]
SPEC_CHOICES = (LAYER_SPECS + tuple(f"fp8-{r}" for r in FP8_RECIPES)
                + tuple(f"fp8-{r}-bf16ends" for r in FP8_RECIPES if r != "delayed"))


def parse_layout(text: str) -> Layout:
    """``"TP,PP,DP[,CP][:SPEC][:packed]"`` -> :class:`Layout` (SPEC a layer spec or
    ``fp8-RECIPE[-bf16ends]``; ``packed``: sequence packing); raises ``argparse.ArgumentTypeError``
    otherwise."""
    sizes, *tags = text.split(":")
    packed = "packed" in tags
    tags = [t for t in tags if t != "packed"]
    parts = sizes.split(",")
    if len(parts) not in (3, 4) or not all(p.isdigit() and int(p) >= 1 for p in parts) \
            or len(tags) > 1:
        raise argparse.ArgumentTypeError(f"a layout is TP,PP,DP[,CP][:SPEC][:packed] with "
                                         f"positive integers, got {text!r}")
    spec = tags[0] if tags else ""
    if spec and spec not in SPEC_CHOICES:
        raise argparse.ArgumentTypeError(f"{text!r}: SPEC is one of {', '.join(SPEC_CHOICES)}")
    fp8 = spec[len("fp8-"):] if spec.startswith("fp8-") else None
    ends = bool(fp8) and fp8.endswith("-bf16ends")
    fp8 = fp8[:-len("-bf16ends")] if ends else fp8
    return Layout(*(int(p) for p in parts), spec="transformer_engine" if fp8 else (spec or None),
                  fp8_recipe=fp8, packed=packed, bf16_ends=ends)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", type=parse_layout, default=DEFAULT_LAYOUTS,
                   metavar="TP,PP,DP[,CP][:SPEC][:packed]",
                   help="layouts to check (default: 2,1,1 1,2,1 1,1,2 2,2,1)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps before the weights are compared")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--layer-spec", default="local", choices=LAYER_SPECS,
                   help="the spec of a layout that names none")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: gloo, no distributed optimizer or overlap (a dry run of the code)")
    p.add_argument("--config", default=None,
                   help="take the model shape from this training config (weights too with "
                        "model.hf_path); the size options are then ignored")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of --config (e.g. model.hf_path=DIR)")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--ffn-hidden-size", type=int, default=1408)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--query-groups", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=32003, help="odd: padded under TP")
    p.add_argument("--rows", type=int, default=32, help="sequences in the global batch")
    p.add_argument("--max-length", type=int, default=256, help="longest sequence (tokens)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                   help="token budget of a packed layout's micro-batches (default: the "
                        "worker's, micro-batch size x the longest row)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--prev-logprobs", choices=("random", "reference"), default="random",
                   help="the loss's old-policy (and KL reference) logprobs: seeded near "
                        "-log(vocab), or the reference layout's own logprobs (ratios near 1, as "
                        "in an RL step; for a pretrained model on random tokens)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rel-tol", type=float, default=2e-2, help="logprobs and loss")
    p.add_argument("--grad-norm-tol", type=float, default=5e-2)
    p.add_argument("--preset", choices=("llama8b",), default=None,
                   help="a model shape replacing the size options (module docstring)")
    p.add_argument("--init", choices=("transformers", "normal"), default="transformers",
                   help="the seeded random start (model.init)")
    p.add_argument("--reference", type=parse_layout, nargs="+", default=[Layout(1, 1, 1)],
                   metavar="TP,PP,DP[,CP][:SPEC][:packed]",
                   help="the layout(s) the others are compared with (default 1,1,1: one GPU); "
                        "with several, every layout against each")
    args = p.parse_args(argv)
    args.hf_path = None
    if args.config:
        from mcore_rl.config.loader import load_config
        from mcore_rl.planning import resolve_arch

        cfg = load_config(args.config, args.set)
        args.arch, args.vocab_size = resolve_arch(cfg)
        args.hf_path = cfg.model.hf_path
        args.max_length = min(args.max_length, args.arch.max_position_embeddings)
    elif args.set:
        p.error("--set needs --config")
    if args.preset == "llama8b":
        args.num_layers, args.hidden_size, args.ffn_hidden_size = 32, 4096, 14336
        args.heads, args.query_groups, args.vocab_size = 32, 8, 128256
        args.init = "normal"
    return args


def _arch(args) -> ModelArchConfig:
    if getattr(args, "arch", None) is not None:  # --config
        return args.arch
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


def worker_kwargs(args, layout: Layout) -> dict:
    """PolicyWorker arguments of one layout (the DP size follows from the world size)."""
    arch = _arch(args)
    spec = layout.spec or args.layer_spec
    gpu = args.device == "cuda"
    megatron = MegatronConfig(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        # the torch spec's CP all-gathers keys and values; TE's ring (p2p) is the default
        cp_comm_type="all_gather" if spec == "torch" else "p2p",
        precision=args.precision, layer_spec=spec,
        fp8="hybrid" if layout.fp8_recipe else None, fp8_recipe=layout.fp8_recipe or "delayed",
        fp8_bf16_layers_at_start=int(layout.bf16_ends),
        fp8_bf16_layers_at_end=int(layout.bf16_ends),
        ddp=DDPConfig(overlap_grad_reduce=gpu, grad_reduce_in_fp32=True,
                      use_distributed_optimizer=gpu, overlap_param_gather=gpu))
    return dict(hf_path=args.hf_path,
                hf_config=arch_to_hf_config(arch, args.vocab_size).to_dict(),
                vocab_size=args.vocab_size, temperature=1.0, use_reference=False, init=args.init,
                arch=arch,
                megatron=megatron, optimizer=OptimizerConfig(lr=args.lr, clip_grad=1.0),
                device=args.device, seed=args.seed, total_optimizer_steps=args.steps,
                global_batch_size=args.rows, sequence_packing=layout.packed,
                max_tokens_per_microbatch=args.max_tokens_per_microbatch if layout.packed else None)


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


def valid_positions(batch: B.Batch) -> torch.Tensor:
    """``[B, S]`` bool: positions 1 .. length - 1 of each row (those with a logprob)."""
    cols = torch.arange(batch["input_ids"].shape[1])[None, :]
    return (cols >= 1) & (cols < batch["input_lengths"][:, None])


def run_layout(args, layout: Layout, batch: B.Batch, loss) -> parity.StepRecord:
    """``args.steps`` steps on the layout's processes; the record of the first step's logprobs
    and metrics with the weights after the last step."""
    kwargs = worker_kwargs(args, layout)
    # FP8 blockwise: the config's block scales (fp32 by default) set before TE loads, as the trainer
    env = [te_environment(kwargs["megatron"])] * layout.world
    group = ProcessWorkerGroup(PolicyWorker, layout.world, kwargs, env_per_rank=env)
    try:
        dp_group = DataParallelGroup(group)
        mbs = args.micro_batch_size
        if args.prev_logprobs == "reference" and not getattr(args, "prev_set", False):
            # the first run (the reference) sets them for every run after it
            own = dp_group.gather_rows(PolicyAPI).get_logprobs(batch, mbs) * batch["token_mask"]
            batch["prev_logprobs"], batch["reference_logprobs"] = own, own.clone()
            args.prev_set = True
        record = parity.record_step(dp_group, batch, loss, mbs, mbs)
        for _ in range(args.steps - 1):
            dp_group.train(batch, loss, mbs)
        if args.steps > 1:
            record.weights = group.call(PolicyAPI).get_hf_weights()[0]
        return record
    finally:
        group.shutdown()


def main(argv: Optional[List[str]] = None) -> int:
    """Run every reference and every layout, print the table (each layout against each
    reference); 0 when all are within tolerance (FP8 rows are reported only)."""
    args = parse_args(argv)
    need = max(layout.world for layout in args.layouts + args.reference)
    if args.device == "cuda" and torch.cuda.device_count() < need:
        print(f"needs {need} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    batch, loss = make_batch(args), ClippedPGLoss(LossConfig(kl_coef=0.05))
    mask = valid_positions(batch)
    references = [(ref.name(args.layer_spec), run_layout(args, ref, batch, loss))
                  for ref in args.reference]
    several = len(references) > 1
    tolerances = {}
    for ref_name, ref in references:
        largest = max(w.abs().max().item() for w in ref.weights.values())
        tolerances[ref_name] = {"logprobs_rel": args.rel_tol, "loss_rel": args.rel_tol,
                                "grad_norm_rel": args.grad_norm_tol,
                                "params_max_abs": 2 * args.lr * args.steps + 2.0 ** -8 * largest}
    rows, metrics, failed = {}, {}, []
    for layout in args.layouts:
        name = layout.name(args.layer_spec)
        record = run_layout(args, layout, batch, loss)
        metrics[name] = record.metrics
        for ref_name, ref in references:
            row = f"{name} vs {ref_name}" if several else name
            rows[row] = parity.compare(record, ref, mask)
            if layout.fp8_recipe is None:
                failed += [f"{row}: {k} = {rows[row][k]:.2e} > {tol:.2e}"
                           for k, tol in tolerances[ref_name].items() if not rows[row][k] <= tol]
    ddp = ("distributed optimizer, overlap_grad_reduce, overlap_param_gather"
           if args.device == "cuda" else "gloo, Megatron's DDP without overlap")
    budget = (f", packed budget {args.max_tokens_per_microbatch} tokens"
              if args.max_tokens_per_microbatch else "")
    print(f"{args.precision} on {args.device}, {ddp}; {args.rows} rows up to {args.max_length} "
          f"tokens{budget}, "
          f"{args.steps} step(s), lr {args.lr}; reference: {', '.join(n for n, _ in references)}"
          f"{f'; weights {args.hf_path}' if args.hf_path else ''}")
    tol_rows = {(f"tolerance vs {n}" if several else "tolerance"): t for n, t in tolerances.items()}
    print(parity.parity_table({**rows, **tol_rows}, parity.DIFF_KEYS + parity.DETAIL_KEYS))
    named = [(f"reference {n}" if several else "reference", r.metrics) for n, r in references]
    width = max(len(n) for n in [*metrics, *(n for n, _ in named)])
    for name, m in [*named, *metrics.items()]:
        print(f"{name:<{width}}  loss {m['loss']:.6f}  grad norm {m['grad_norm']:.6f}")
    for line in failed:
        print("FAIL", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
