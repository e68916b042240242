"""Wall time per optimizer step: sync ``train()`` versus the split train-step API.

The split path is ``begin_train_step`` + one ``train_microbatch`` per piece of each DP rank's
rows + ``finish_train_step``, each a separate controller call, as a streaming controller
makes them; the sync path is one ``train()`` call on the same rows. Both are timed at the
controller (the calls return after the optimizer step: their metrics are host floats, so the
device work is done), alternating sync and split steps so drift hits both alike.

With ``--parity`` it first checks that the two paths give the same parameters: a worker
group takes ``--parity-steps`` sync steps and is shut down, a fresh one (the same seeded
initial weights) takes the same steps split, and the largest absolute parameter difference
is printed (rows all have the full length, so both paths run identical micro-batches). The
timings then run on the second group.

Usage (one GPU per DP rank; TP = PP = 1)::

    python bench/split_step.py --preset 1b --dp 1 --device cuda --precision bf16 \\
        --distributed-optimizer --parity
    python bench/split_step.py --preset tiny --dp 2 --device cpu   # a CPU smoke run

Prints a table: per path, ms per optimizer step (mean, median, min over ``--steps`` after
``--warmup``), tokens per second, and the split path's overhead against sync.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.schema import DDPConfig, LossConfig, MegatronConfig, ModelArchConfig, OptimizerConfig
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import ProcessWorkerGroup
from mcore_rl.megatron.conversion import arch_to_hf_config
from mcore_rl.megatron.parallel import resolve_device
from mcore_rl.workers.policy import PolicyWorker

# Model shapes: "tiny" for a CPU smoke run; "1b" is TinyLlama-1.1B's shape (22 layers,
# hidden 2048, 32 heads, 4 KV groups, SwiGLU 5632, vocab 32000: 1.10e9 parameters).
PRESETS = {
    "tiny": dict(arch=dict(family="qwen2", num_layers=2, hidden_size=64, num_attention_heads=4,
                           num_query_groups=2, ffn_hidden_size=128, qkv_bias=True),
                 vocab=128, seq_len=64, global_batch=8, micro_batch=2),
    "1b": dict(arch=dict(family="llama", num_layers=22, hidden_size=2048, num_attention_heads=32,
                         num_query_groups=4, ffn_hidden_size=5632, qkv_bias=False),
               vocab=32000, seq_len=2048, global_batch=16, micro_batch=2),
}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (processes)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--precision", default="fp32", help="fp32 or bf16")
    p.add_argument("--layer-spec", default="local", help="policy.megatron.layer_spec")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--manual-gc-interval", type=int, default=0,
                   help="cluster.manual_gc_interval of the workers (0: automatic collection)")
    p.add_argument("--seq-len", type=int, help="tokens per row (default: the preset's)")
    p.add_argument("--global-batch", type=int, help="rows per optimizer step (default: preset)")
    p.add_argument("--micro-batch", type=int, help="rows per forward/backward (default: preset)")
    p.add_argument("--rows-per-call", type=int,
                   help="rows per train_microbatch call (default: --micro-batch)")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per path")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per path first")
    p.add_argument("--parity", action="store_true", help="check sync == split parameters first")
    p.add_argument("--parity-steps", type=int, default=2)
    args = p.parse_args()
    preset = PRESETS[args.preset]
    for key in ("seq_len", "global_batch", "micro_batch"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    args.rows_per_call = args.rows_per_call or args.micro_batch
    if args.global_batch % args.dp:
        p.error(f"--global-batch ({args.global_batch}) must be divisible by --dp ({args.dp})")
    if (args.global_batch // args.dp) % args.rows_per_call:
        p.error(f"rows per DP rank ({args.global_batch // args.dp}) must be divisible by "
                f"--rows-per-call ({args.rows_per_call})")
    return args


def _batch(n: int, seq_len: int, vocab: int) -> B.Batch:
    """``n`` full-length rows of random tokens; the second half of each row is the response."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(n, seq_len)
    mask[:, seq_len // 2:] = 1
    return {
        "input_ids": torch.randint(1, vocab, (n, seq_len), generator=g),
        "input_lengths": torch.full((n,), seq_len),
        "token_mask": mask,
        "sample_mask": torch.ones(n),
        "advantages": torch.randn(n, 1, generator=g) * mask,
    }


class _Bench:
    def __init__(self, args):
        self.args = args
        preset = PRESETS[args.preset]
        vocab = preset["vocab"]
        arch = ModelArchConfig(**preset["arch"], max_position_embeddings=args.seq_len,
                               tie_word_embeddings=False, vocab_size=vocab)
        self.num_params = None
        self.kwargs = dict(
            hf_path=None, hf_config=arch_to_hf_config(arch, vocab).to_dict(), vocab_size=vocab,
            arch=arch,
            megatron=MegatronConfig(precision=args.precision, layer_spec=args.layer_spec,
                                    ddp=DDPConfig(overlap_grad_reduce=args.overlap_grad_reduce,
                                                  use_distributed_optimizer=args.distributed_optimizer)),
            optimizer=OptimizerConfig(lr=1e-5, clip_grad=1.0),
            device=resolve_device(args.device), seed=1, total_optimizer_steps=1000,
            global_batch_size=args.global_batch, manual_gc_interval=args.manual_gc_interval,
        )
        self.shards = B.shard(_batch(args.global_batch, args.seq_len, vocab), args.dp)
        self.loss = ClippedPGLoss(LossConfig())
        self.group = None

    def start(self) -> None:
        """A fresh worker group (seeded initial weights); ``prev_logprobs`` of its policy."""
        self.group = ProcessWorkerGroup(PolicyWorker, self.args.dp, self.kwargs)
        lp = self.group.call_each("get_logprobs", [[s, self.args.micro_batch] for s in self.shards])
        for s, x in zip(self.shards, lp):
            s["prev_logprobs"] = x

    def sync_step(self):
        a = self.args
        return self.group.call_each("train", [[s, self.loss, a.global_batch, a.micro_batch]
                                              for s in self.shards])[0]

    def split_step(self):
        a = self.args
        self.group.call("begin_train_step", self.loss, a.global_batch, a.micro_batch)
        rows = B.batch_size(self.shards[0])
        for i in range(0, rows, a.rows_per_call):
            piece = slice(i, i + a.rows_per_call)
            self.group.call_each("train_microbatch", [[B.select(s, piece)] for s in self.shards])
        return self.group.call("finish_train_step")[0]

    def parity(self) -> float:
        """Largest |sync - split| over all parameters after ``--parity-steps`` steps of each
        path from the same initial weights (two groups, one after the other)."""
        self.start()
        try:
            for _ in range(self.args.parity_steps):
                self.sync_step()
            ref = self.group.call("get_hf_weights")[0]
        finally:
            self.group.shutdown()
        self.start()
        for _ in range(self.args.parity_steps):
            self.split_step()
        out = self.group.call("get_hf_weights")[0]
        self.num_params = sum(t.numel() for t in ref.values())
        return max((out[k].float() - ref[k].float()).abs().max().item() for k in ref)

    def timings(self):
        times = {"sync": [], "split": []}
        steps = {"sync": self.sync_step, "split": self.split_step}
        for i in range(self.args.warmup + self.args.steps):
            for name, step in steps.items():
                t0 = time.perf_counter()
                step()
                if i >= self.args.warmup:
                    times[name].append(time.perf_counter() - t0)
        return times


def main() -> None:
    args = _parse()
    # Multi-GPU hygiene of the GPU machines (inherited by the spawned workers).
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")
    bench = _Bench(args)
    try:
        diff = None
        if args.parity:
            diff = bench.parity()  # leaves the second group started
        else:
            bench.start()
        times = bench.timings()
    finally:
        if bench.group is not None:
            bench.group.shutdown()
    device = resolve_device(args.device)
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    tokens = args.global_batch * args.seq_len
    print(f"\nsplit train step vs sync train(): preset {args.preset}"
          + (f" ({bench.num_params / 1e6:,.1f}M params)" if bench.num_params else "")
          + f", DP={args.dp} on {gpu}, {args.precision}, distributed optimizer "
          f"{args.distributed_optimizer}, overlap_grad_reduce {args.overlap_grad_reduce}, "
          f"global batch {args.global_batch} x {args.seq_len} tokens, micro-batch "
          f"{args.micro_batch}, {args.rows_per_call} rows per train_microbatch call, manual GC "
          f"interval {args.manual_gc_interval}")
    if diff is not None:
        print(f"parity after {args.parity_steps} steps: max |w_sync - w_split| = {diff:.3e}")
    base = statistics.mean(times["sync"])
    print(f"{'path':<6} {'steps':>5} {'mean ms':>9} {'median ms':>10} {'min ms':>8} "
          f"{'max ms':>8} {'tokens/s':>10} {'vs sync':>8}")
    for name, ts in times.items():
        mean = statistics.mean(ts)
        print(f"{name:<6} {len(ts):>5} {1e3 * mean:>9.1f} {1e3 * statistics.median(ts):>10.1f} "
              f"{1e3 * min(ts):>8.1f} {1e3 * max(ts):>8.1f} {tokens / mean:>10.0f} "
              f"{100 * (mean / base - 1):>+7.2f}%")
    for name, ts in times.items():  # in order: shows outliers and drift
        print(f"{name} ms per step: " + " ".join(f"{1e3 * t:.0f}" for t in ts))


if __name__ == "__main__":
    main()
