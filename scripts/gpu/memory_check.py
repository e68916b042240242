"""The memory planner (``mcore-rl plan``, mcore_rl/megatron/memory.py) against measured peaks on
one GPU; prints a table last (and writes it to $OUT/memory_check.json).

For each configuration the trainer is built on the GPU exactly as ``mcore-rl train`` builds it
(no Ray), and each phase's peak is read on the policy's worker (``memory_stats``:
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, reset before each call of the
phase; the largest over the phase's calls and ranks):

1. ``synthetic_0.36B``: ``configs/grpo_synthetic_gpu.yaml`` (Qwen2-0.5B shape, char vocab,
   megatron rollouts, bf16), ``sft.steps=2`` then 2 RL steps (validation at start and end).
2. ``smollm2_135m``: ``grpo_gsm8k`` with ``model.hf_path=$MODEL_DIR`` (SmolLM2-135M), cuda,
   bf16, torch spec, megatron rollouts; 2 RL steps (the row of bench/RESULTS.md's first
   measurement). Skipped without ``$MODEL_DIR``.
3. ``smollm2_gsm8k``: ``configs/grpo_smollm2_gsm8k.yaml`` (SmolLM2-135M, 32 x 8 rows, micro-batches
   of 64 and 128-row logprob micro-batches, validation on up to 500 test problems) with
   ``model.hf_path=$MODEL_DIR`` and, when ``$DATA_DIR`` holds ``train.jsonl`` and ``test.jsonl``,
   the full GSM8K (else the package's samples); 2 RL steps. Skipped without ``$MODEL_DIR``.
4. ``bench_0.85B``: the shape of ``bench/train_step.py`` (Llama, 16 layers, hidden 2048, GQA 16/4,
   SwiGLU 5632, vocab 32000 untied, 2048 tokens a row): the trainer built, then two train steps
   of 16 full-length rows (padded micro-batches of 4: packing off) and their logprobs (no
   generation: the benchmark has none, so its prediction leaves out the rollout engine).
5. ``long_cp1`` and ``long_cp2`` (two GPUs; only when ``MEMORY_JOBS`` names them; issue 34 item
   4): one training step of two 32,768-token rows (a 256-token prompt, a 32,512-token response;
   ``LONG_SEQ`` sets the length) on a 1.39B Llama shape (the benchmark's, 28 layers), policy on
   two GPUs at CP=1 (DP=2: a 32k-token micro-batch a GPU) and at CP=2 (the ``torch`` spec's
   all-gather CP: 16k tokens a GPU), the hf rollout engine colocated (the megatron decoder
   does not split sequences), micro-batches of one row, no packing, seeded weights drawn on the
   GPUs (``model.init=normal``: no 1.39B model is initialized on the host). At 32k ``mcore-rl plan``
   predicts 94.6 GiB for CP=1 (does not fit 80) and 66.0 GiB for CP=2; the trainer's own memory
   check is off (``cluster.skip_memory_check``) so the CP=1 step runs and its out-of-memory is
   the measurement: the row then says ``OOM``. On 141 GB H200s: ``LONG_SEQ=65536 LONG_GPU_GB=141``
   (plan 153.6 GiB at CP=1, 103.3 at CP=2). ``LONG_SPEC=transformer_engine`` is refused at
   the trainer's start while TE's CP is unverified (:func:`mcore_rl.megatron.te.runtime_errors`).

Predictions: the plan at ``data.max_total_length`` (what ``mcore-rl plan`` prints: the bound)
and at the longest row and prompt the run saw (the planner's arithmetic with the true lengths:
rows of ``seq`` tokens, the KV cache sized by the longest prompt + ``generation.max_new_tokens``);
the error column compares the latter with max_memory_allocated.

``MEMORY_JOBS`` (comma-separated names of the list above) runs a subset.

Usage (one device call; carry the wheels as scripts/gpu/env.sh expects):
    MODEL_DIR=/path/to/SmolLM2-135M-Instruct bash -c 'source scripts/gpu/env.sh && python3 scripts/gpu/memory_check.py'
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.algorithms.losses import ClippedPGLoss  # noqa: E402
from mcore_rl.config.loader import load_config  # noqa: E402
from mcore_rl.config.schema import LossConfig  # noqa: E402
from mcore_rl.controller.loops import build  # noqa: E402
from mcore_rl.controller.trainer import RLTrainer  # noqa: E402
from mcore_rl.megatron import memory  # noqa: E402
from mcore_rl.planning import resolve_arch  # noqa: E402

GIB = 2.0**30
OUT = os.environ.get("OUT", "/tmp/mcore_rl_out")
PHASES = ("generation", "logprobs", "train")
COMMON = ["cluster.use_ray=false", "cluster.device=cuda", "logging.progress=false",
          "logging.tensorboard=false", "checkpoint.every=0", "checkpoint.save_final=false",
          "cluster.skip_memory_check=true"]
BENCH = ["model.arch.family=llama", "model.arch.num_layers=16", "model.arch.hidden_size=2048",
         "model.arch.num_attention_heads=16", "model.arch.num_query_groups=4",
         "model.arch.ffn_hidden_size=5632", "model.arch.max_position_embeddings=2048",
         "model.arch.rope_theta=10000.0", "model.arch.rms_norm_eps=1e-5",
         "model.arch.qkv_bias=false", "model.arch.tie_word_embeddings=false",
         "model.arch.vocab_size=32000", "data.max_prompt_length=8", "data.max_total_length=2048",
         "policy.micro_batch_size=4", "policy.logprob_micro_batch_size=4",
         "grpo.num_prompts_per_step=8", "grpo.num_generations=2", "sft.steps=0",
         "grpo.val_at_start=false", "grpo.val_every=0", "generation.logprob_budget=null",
         "policy.sequence_packing=false", "policy.max_tokens_per_microbatch=null"]
BENCH_ROWS, BENCH_SEQ = 16, 2048
LONG_SEQ = int(os.environ.get("LONG_SEQ", "32768"))
LONG_ROWS = 2
# The benchmark's shape at 28 layers (1.39B): at 32k tokens a row it fits two 80 GB GPUs at CP=2
# and not at CP=1 (module docstring); the overrides of both long_cp jobs but CP.
LONG = [o for o in BENCH if not o.startswith(("model.arch.num_layers", "model.arch.max_position",
                                               "data.max_total_length", "policy.micro_batch_size",
                                               "policy.logprob_micro_batch_size",
                                               "grpo.num_prompts_per_step"))] + [
    "model.arch.num_layers=28", f"model.arch.max_position_embeddings={LONG_SEQ}",
    "data.max_prompt_length=256", f"data.max_total_length={LONG_SEQ}",
    f"generation.max_new_tokens={LONG_SEQ - 256}", "generation.backend=hf",
    "generation.batch_size=2", "policy.micro_batch_size=1", "policy.logprob_micro_batch_size=1",
    "grpo.num_prompts_per_step=1", "cluster.num_workers=2", "model.init=normal",
    f"cluster.gpu_memory_gb={os.environ.get('LONG_GPU_GB', '80')}",
    f"policy.megatron.layer_spec={os.environ.get('LONG_SPEC', 'torch')}",
    "policy.megatron.cp_comm_type=all_gather"]


class Recorder:
    """Wraps the trainer's phase calls: resets the workers' peaks before each, reads them after;
    keeps the largest peak by phase and the longest row and prompt seen."""

    def __init__(self, trainer: RLTrainer):
        self.trainer = trainer
        self.peaks: Dict[str, Dict[str, int]] = {}
        self.longest = 0
        self.longest_prompt = 0
        t = trainer
        # the rollout, whichever way the producer makes it (reward.score_while_decoding:
        # generate_scored, which returns (rollout, pending rewards))
        for name in ("generate", "generate_scored"):
            setattr(t.producer, name, self._wrap("generation", getattr(t.producer, name),
                                                 result_rows=True))
        t.policy_logprobs = self._wrap("logprobs", t.policy_logprobs)
        t.train_policy = self._wrap("train", t.train_policy)

    def _stats(self, reset: bool) -> List[Dict[str, int]]:
        return self.trainer.policy.call("memory_stats", reset)

    def _wrap(self, phase: str, fn, result_rows: bool = False):
        def wrapped(*args, **kwargs):
            self._stats(True)
            out = fn(*args, **kwargs)  # the workers answer after their work is done
            stats = self._stats(False)
            peak = self.peaks.setdefault(phase, {"max_allocated": 0, "max_reserved": 0})
            for key in peak:
                peak[key] = max(peak[key], *(s[key] for s in stats))
            batch = (out[0] if isinstance(out, tuple) else out) if result_rows else (
                args[0] if args else None)
            if isinstance(batch, dict) and "input_lengths" in batch:
                self.longest = max(self.longest, int(batch["input_lengths"].max()))
            if result_rows and isinstance(batch, dict) and "prompt_lengths" in batch:
                self.longest_prompt = max(self.longest_prompt, int(batch["prompt_lengths"].max()))
            return out

        return wrapped


def bench_rollout(vocab: int, rows: int = BENCH_ROWS,
                  seq: int = BENCH_SEQ) -> Dict[str, torch.Tensor]:
    """bench/train_step.py's rows: a 256-token prompt and a response to the end."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(rows, seq)
    mask[:, 256:] = 1
    return {"input_ids": torch.randint(1, vocab, (rows, seq), generator=g),
            "input_lengths": torch.full((rows,), seq),
            "prompt_lengths": torch.full((rows,), 256), "token_mask": mask,
            "sample_mask": torch.ones(rows),
            "advantages": torch.randn(rows, 1, generator=g) * mask,
            "prev_logprobs": torch.zeros(rows, seq),
            "generation_logprobs": torch.zeros(rows, seq)}


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (raised here or a worker's error passed on) is CUDA's out-of-memory."""
    text = f"{type(error).__name__}: {error}"
    return "OutOfMemoryError" in text or "CUDA out of memory" in text


def measure(name: str, config: str, overrides: List[str], bench: bool = False,
            rows: int = BENCH_ROWS, seq: int = BENCH_SEQ, steps: int = 2) -> List[Dict]:
    run_dir = tempfile.mkdtemp(prefix=f"memcheck_{name}_")
    cfg = load_config(config, COMMON + overrides + [f"run.output_dir={run_dir}/run"])
    arch, vocab = resolve_arch(cfg)
    start = time.perf_counter()
    loop = build(cfg)
    trainer = loop.trainer
    oom = None
    try:
        rec = Recorder(trainer)
        if bench:
            batch = bench_rollout(vocab, rows, seq)
            rec.longest = seq  # the planner's seq also when the first call runs out of memory
            for _ in range(steps):
                trainer.policy_logprobs(batch)
                trainer.train_policy(batch, ClippedPGLoss(LossConfig(kl_coef=0.0)))
        else:
            loop.fit()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        oom = " ".join(str(e).split())[-300:]
        print(f"\n== {name}: out of memory: {oom}", flush=True)
    finally:
        loop.close()
    seconds = time.perf_counter() - start
    bound = memory.plan_memory(cfg, arch, vocab)
    seen = memory.plan_memory(cfg, arch, vocab, seq=rec.longest or None,
                              train_rows=rows if bench else None,
                              prompt=rec.longest_prompt or None)
    print(f"\n== {name}: {memory.model_parameters(arch, vocab) / 1e6:.1f}M parameters, longest "
          f"row {rec.longest} tokens, longest prompt {rec.longest_prompt}, {seconds:.0f} s\n"
          f"{memory.format_plan(seen)}", flush=True)
    table = []
    gpu = seen.gpu_bytes / GIB
    for phase in PHASES:
        if oom and phase in seen.phases and phase in ("logprobs", "train") \
                and rec.peaks.get(phase, {}).get("max_allocated", 0) == 0:
            planned = (seen.phases[phase] - (sum(seen.engine.values()) if bench else 0)) / GIB
            table.append({"config": name, "phase": phase, "measured_alloc_gib": float("nan"),
                          "measured_reserved_gib": float("nan"), "plan_max_len_gib": planned,
                          "plan_seen_len_gib": planned, "error_pct": float("nan"),
                          "longest": rec.longest, "oom": True,
                          "plan_fits": seen.phases[phase] <= seen.gpu_bytes})
            continue
        if phase not in rec.peaks or phase not in seen.phases:  # not run (seen.not_run)
            continue
        engine = sum(seen.engine.values()) if bench else 0  # the benchmark decodes nothing
        predicted = seen.phases[phase] - engine
        measured = rec.peaks[phase]["max_allocated"]
        table.append({"config": name, "phase": phase,
                     "measured_alloc_gib": measured / GIB,
                     "measured_reserved_gib": rec.peaks[phase]["max_reserved"] / GIB,
                     "plan_max_len_gib": (bound.phases[phase] - (sum(bound.engine.values()) if bench else 0)) / GIB,
                     "plan_seen_len_gib": predicted / GIB,
                     "error_pct": 100.0 * (predicted - measured) / measured if measured else float("nan"),
                     "longest": rec.longest, "oom": False,
                     "plan_fits": seen.phases[phase] <= seen.gpu_bytes})
    print(f"== {name}: plan {'fits' if all(r['plan_fits'] for r in table) else 'DOES NOT FIT'} "
          f"{gpu:.0f} GiB; measured {'OUT OF MEMORY' if oom else 'ran'}", flush=True)
    return table


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    jobs = [("synthetic_0.36B", "grpo_synthetic_gpu", ["sft.steps=2", "grpo.max_steps=2"], False)]
    model_dir = os.environ.get("MODEL_DIR")
    if model_dir:
        jobs.append(("smollm2_135m", "grpo_gsm8k", [
            f"model.hf_path={model_dir}", "policy.megatron.precision=bf16",
            "policy.megatron.layer_spec=torch", "generation.backend=megatron",
            "grpo.max_steps=2"], False))
        data_dir = os.environ.get("DATA_DIR")
        data = []
        if data_dir and all(os.path.isfile(os.path.join(data_dir, f))
                            for f in ("train.jsonl", "test.jsonl")):
            data = [f"data.train_path={data_dir}/train.jsonl",
                    f"data.test_path={data_dir}/test.jsonl"]
        jobs.append(("smollm2_gsm8k", "grpo_smollm2_gsm8k", [
            f"model.hf_path={model_dir}", "grpo.max_steps=2", *data], False))
    else:
        print("MODEL_DIR unset: smollm2_135m and smollm2_gsm8k skipped", flush=True)
    jobs.append(("bench_0.85B", "grpo_synthetic_gpu", BENCH, True))
    wanted = [j for j in os.environ.get("MEMORY_JOBS", "").split(",") if j]
    long_jobs = [(f"long_cp{cp}", "grpo_synthetic_gpu",
                  LONG + [f"policy.megatron.context_parallel_size={cp}"], True) for cp in (1, 2)]
    if wanted:  # a subset by name (MEMORY_JOBS=synthetic_0.36B,bench_0.85B), in the order above
        jobs = [j for j in jobs + long_jobs if j[0] in wanted]
    table, status = [], 0
    for name, config, overrides, bench in jobs:
        long = name.startswith("long_cp")
        try:
            table += measure(name, config, overrides, bench,
                             **(dict(rows=LONG_ROWS, seq=LONG_SEQ, steps=1) if long else {}))
        except Exception:  # the other configurations still run
            traceback.print_exc()
            status = 1
    with open(os.path.join(OUT, "memory_check.json"), "w") as f:
        json.dump(table, f, indent=2)
    print(f"\nGPU: {torch.cuda.get_device_name()}; GiB per GPU (policy worker, "
          f"max_memory_allocated / max_memory_reserved); plan at data.max_total_length and at "
          f"the longest row seen; error = plan(seen) vs allocated")
    print(f"{'config':16s} {'phase':11s} {'alloc':>7s} {'reserved':>8s} {'plan@max':>8s} "
          f"{'plan@seen':>9s} {'error':>7s} {'longest':>7s}  plan")
    for r in table:
        alloc = "OOM" if r["oom"] else f"{r['measured_alloc_gib']:.2f}"
        reserved = "-" if r["oom"] else f"{r['measured_reserved_gib']:.2f}"
        print(f"{r['config']:16s} {r['phase']:11s} {alloc:>7s} {reserved:>8s} "
              f"{r['plan_max_len_gib']:8.2f} {r['plan_seen_len_gib']:9.2f} "
              f"{r['error_pct']:+6.1f}% {r['longest']:7d}  "
              f"{'fits' if r['plan_fits'] else 'does not fit'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
