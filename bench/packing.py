"""GPU benchmark: padded vs packed (THD) micro-batches in training and logprobs; prints one table.

Through the product's own :class:`PolicyWorker` on one GPU (Megatron DDP and optimizer, bf16,
``torch`` layer spec, no Ray): an RL-shaped batch of ``--rows`` right-padded rollouts (prompts
of ``--prompt-min .. --prompt-max`` tokens, responses of ``1 .. --max-new`` tokens, uniform:
the GSM8K shape of issue 22 by default, 256 rows of <= ~150 + 256 tokens) is trained for one
optimizer step (``PolicyWorker.train``, ``ClippedPGLoss``) and its logprobs computed
(``get_logprobs``), for each case:

- ``padded mbs=M/L``: fixed micro-batches of M training rows and L logprob rows (today's path);
- ``padded budget=N``: length-sorted micro-batches under a budget of N padded tokens;
- ``packed budget=N``: sequence packing (``sequence_packing=True``), N tokens per packed
  micro-batch (FlexAttention document mask, compiled on the first call of each length).

Columns: median seconds of a train step and a logprob pass over ``--steps`` timed repetitions
after ``--warmup`` (synchronized), the step's ``padding_fraction`` and micro-batch count, valid
tokens per second of each phase and the max logprob difference against the first case
(bf16: expect ~1e-2 at most on valid tokens, from summation order).

Model: ``--hf-path`` (a Hugging Face checkpoint directory, weights loaded) or ``--arch
smollm2-135m`` (SmolLM2-135M's shape, random weights: 30 layers, hidden 576, 9 heads / 3 KV
groups, SwiGLU 1536, vocab 49152, tied). Example (one H100)::

    python bench/packing.py --arch smollm2-135m --cases padded:16/64,padded:64/256,packed:16384,packed:32768
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcore_rl.algorithms.losses import ClippedPGLoss  # noqa: E402
from mcore_rl.config.schema import (  # noqa: E402
    LossConfig, MegatronConfig, ModelArchConfig, OptimizerConfig)
from mcore_rl.megatron.conversion import arch_to_hf_config, hf_config_to_arch  # noqa: E402

ARCHS = {
    "smollm2-135m": ModelArchConfig(
        family="llama", num_layers=30, hidden_size=576, num_attention_heads=9, num_query_groups=3,
        ffn_hidden_size=1536, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, qkv_bias=False, tie_word_embeddings=True, vocab_size=49152),
}


def rollout(rows: int, vocab: int, prompt_min: int, prompt_max: int, max_new: int,
            seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(prompt_min, prompt_max + 1, (rows,), generator=g)
    rlen = torch.randint(1, max_new + 1, (rows,), generator=g)
    lengths = plen + rlen
    width = int(lengths.max())
    pos = torch.arange(width)[None]
    ids = torch.randint(1, vocab, (rows, width), generator=g) * (pos < lengths[:, None])
    mask = ((pos >= plen[:, None]) & (pos < lengths[:, None])).float()
    return {"input_ids": ids, "input_lengths": lengths, "prompt_lengths": plen,
            "token_mask": mask, "sample_mask": torch.ones(rows),
            "advantages": torch.randn(rows, 1, generator=g) * mask}


def build(arch: ModelArchConfig, hf_path, case: str, rows: int, port: int):
    from mcore_rl.workers.policy import PolicyWorker

    kind, _, arg = case.partition(":")
    kw = {}
    if kind == "packed":
        kw = dict(sequence_packing=True, max_tokens_per_microbatch=int(arg))
    elif kind == "padded" and "/" not in arg:
        kw = dict(max_tokens_per_microbatch=int(arg))
    return PolicyWorker(
        hf_path=hf_path, hf_config=arch_to_hf_config(arch, arch.vocab_size).to_dict(),
        vocab_size=arch.vocab_size, temperature=1.0, use_reference=False, arch=arch,
        megatron=MegatronConfig(precision="bf16", layer_spec="torch"),
        optimizer=OptimizerConfig(lr=1e-7, clip_grad=1.0), rank=0, world_size=1,
        master_addr="127.0.0.1", master_port=port, device="cuda", seed=1,
        total_optimizer_steps=1000, global_batch_size=rows, **kw)


def timed(fn, warmup: int, steps: int):
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-path", default=None)
    p.add_argument("--arch", default="smollm2-135m", choices=sorted(ARCHS))
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt-min", type=int, default=60)
    p.add_argument("--prompt-max", type=int, default=150)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--cases", default="padded:16/64,padded:64/256,padded:16384,packed:8192,"
                                      "packed:16384,packed:32768",
                   help="padded:TRAIN_ROWS/LOGPROB_ROWS, padded:TOKEN_BUDGET, packed:TOKEN_BUDGET")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args()
    if a.hf_path:
        from transformers import AutoConfig

        arch = hf_config_to_arch(AutoConfig.from_pretrained(a.hf_path))
    else:
        arch = ARCHS[a.arch]
    batch = rollout(a.rows, arch.vocab_size, a.prompt_min, a.prompt_max, a.max_new)
    valid = int(batch["input_lengths"].sum())
    loss = ClippedPGLoss(LossConfig(kl_coef=0.0))
    results: List[Dict] = []
    reference = None
    for i, case in enumerate(a.cases.split(",")):
        worker = build(arch, a.hf_path, case, a.rows, 29500 + i)
        train_rows, lp_rows = 16, 64
        if case.startswith("padded:") and "/" in case:
            train_rows, lp_rows = (int(x) for x in case.split(":")[1].split("/"))
        lp_time, lp = timed(lambda: worker.get_logprobs(batch, lp_rows), a.warmup, a.steps)
        b = dict(batch, prev_logprobs=lp)
        tr_time, metrics = timed(lambda: worker.train(b, loss, a.rows, train_rows), a.warmup, a.steps)
        diff = float("nan") if reference is None else \
            float(((lp - reference).abs() * (batch["token_mask"] > 0)).max())
        reference = lp if reference is None else reference
        results.append(dict(case=case, train_s=tr_time, logprobs_s=lp_time,
                            padding_fraction=metrics["padding_fraction"],
                            microbatch_tokens_max=metrics["microbatch_tokens_max"],
                            train_tok_s=valid / tr_time, logprobs_tok_s=valid / lp_time,
                            logprob_diff=diff))
        del worker
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}  {a.hf_path or a.arch}  rows={a.rows}  "
          f"valid tokens={valid}  padded width={batch['input_ids'].shape[1]}")
    print(f"{'case':<22}{'train s':>9}{'logprobs s':>12}{'pad frac':>10}{'mb tok max':>12}"
          f"{'train tok/s':>13}{'lp tok/s':>11}{'lp diff':>9}")
    for r in results:
        print(f"{r['case']:<22}{r['train_s']:>9.3f}{r['logprobs_s']:>12.3f}"
              f"{r['padding_fraction']:>10.3f}{r['microbatch_tokens_max']:>12.0f}"
              f"{r['train_tok_s']:>13.0f}{r['logprobs_tok_s']:>11.0f}{r['logprob_diff']:>9.2g}")


if __name__ == "__main__":
    main()
