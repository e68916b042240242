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

   On a GPU larger than 80 GB, ``LONG_CAP_GIB=79`` keeps 32k rows meaningful instead: before the
   long jobs this process fills every visible GPU until ``LONG_CAP_GIB`` GiB are free (one
   ballast tensor a GPU, freed at the end), so the workers see what an untouched 80 GB H100
   offers (81,559 MiB, about 79 GiB free), their CUDA contexts, NCCL buffers and the hf engine
   included: a faithful 80 GB card where ``torch.cuda.set_per_process_memory_fraction`` would
   cap only the caching allocator of the process that sets it (the workers are spawned
   processes) and leave contexts and NCCL outside the cap. ``session.sh cp2`` does this on
   H200s (32k rows: the issue's 16k-32k responses, a quarter of 64k's attention work).

   The hf engine (never called here) lives in this process on GPU 0, in fp32: 5.6 GB more on
   GPU 0 than on GPU 1 for the 1.39B shape. The likely reason why the first 64k-token run
   (two H200s, CP=1 first) printed nothing in 300 s: rank 0 runs out of memory first, rank 1
   goes on into the next collective and waits there for it (NCCL's timeout is 30 minutes, and
   a call is answered when both ranks have answered); not confirmed, hence the deadline's
   report below. After the build each long job holds memory on the GPUs with more free until
   every GPU has the same free memory as the least free one (the planner counts the engine
   on every policy GPU as well).

   Each job prints a start line with its plan (``== NAME: start``), its milestones (built,
   logprobs, train) and its result as soon as it ends, all flushed. A long job that gets no
   answer within ``LONG_JOB_TIMEOUT`` seconds (default 200) is stopped: the line names the calls
   no rank answered (one rank out of memory while the other waits in a collective for it is
   the hang this guards against: both answer only together), the workers are killed, the row
   says ``NO ANSWER``, and the next job runs.

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
import threading
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
# module docstring: the free GiB each GPU is left with before the long jobs (unset: all of it)
LONG_CAP_GIB = float(os.environ["LONG_CAP_GIB"]) if os.environ.get("LONG_CAP_GIB") else None
LONG_JOB_TIMEOUT = float(os.environ.get("LONG_JOB_TIMEOUT", "200"))
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


def run_with_deadline(fn, seconds: float | None):
    """``fn()``; with ``seconds``, in a daemon thread waited for that long. Returns ``(done,
    error)``: ``done`` False when ``fn`` had not returned by then (it is left running)."""
    if seconds is None:
        try:
            fn()
        except Exception as e:
            return True, e
        return True, None
    box = {}

    def target():
        try:
            fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return (False, None) if thread.is_alive() else (True, box.get("error"))


def stop_unanswered(name: str, seconds: float) -> None:
    """A job's workers gave no answer in ``seconds``: print the calls no rank answered, kill
    every worker group of this process (a hung rank answers nothing else)."""
    from mcore_rl.distributed.worker_group import live_groups

    groups = live_groups()
    pending = [f"{g.name} rank {rank} {method} ({age:.0f} s)" for g in groups
               for rank, method, age in g.pending_calls()]
    print(f"\n== {name}: NO ANSWER in {seconds:.0f} s; calls not answered: "
          f"{', '.join(pending) or 'none'} (a rank that has answered is not listed: one rank out "
          f"of memory and the other waiting for it in a collective shows as the other alone); "
          f"{len(groups)} worker group(s) killed", flush=True)
    for g in groups:
        g.kill()


def plan_line(plan) -> str:
    """``logprobs 12.3, train 45.6 GiB: fits 80 GiB`` of a :class:`MemoryPlan`."""
    phases = ", ".join(f"{p} {plan.phases[p] / GIB:.1f}" for p in PHASES if p in plan.phases)
    fits = all(v <= plan.gpu_bytes for v in plan.phases.values())
    return f"{phases} GiB: {'fits' if fits else 'DOES NOT FIT'} {plan.gpu_bytes / GIB:.0f} GiB"


def measure(name: str, config: str, overrides: List[str], bench: bool = False,
            rows: int = BENCH_ROWS, seq: int = BENCH_SEQ, steps: int = 2,
            deadline: float | None = None) -> List[Dict]:
    run_dir = tempfile.mkdtemp(prefix=f"memcheck_{name}_")
    cfg = load_config(config, COMMON + overrides + [f"run.output_dir={run_dir}/run"])
    arch, vocab = resolve_arch(cfg)
    mg = cfg.policy.megatron
    plan0 = memory.plan_memory(cfg, arch, vocab, seq=seq if bench else None,
                               train_rows=rows if bench else None)
    # free memory only where this process holds GPUs already (LONG_CAP_GIB): a first CUDA
    # call here would take a context's memory from the workers
    free = "; " + ", ".join(f"GPU {d} {torch.cuda.mem_get_info(d)[0] / GIB:.1f} GiB free"
                            for d in range(torch.cuda.device_count())) \
        if torch.cuda.is_initialized() else ""
    print(f"\n== {name}: start: {memory.model_parameters(arch, vocab) / 1e9:.2f}B parameters, "
          f"{cfg.cluster.num_workers} GPU(s) at TP={mg.tensor_model_parallel_size} "
          f"CP={mg.context_parallel_size}, {mg.layer_spec} spec, "
          + (f"{steps} step(s) of {rows} rows x {seq} tokens; " if bench else "")
          + f"plan per GPU {plan_line(plan0)}{free}"
          + (f"; no answer in {deadline:.0f} s stops it" if deadline else ""), flush=True)
    start = time.perf_counter()
    loop = build(cfg)
    print(f"== {name}: built in {time.perf_counter() - start:.0f} s", flush=True)
    # long jobs: the hf engine sits on GPU 0 (this process, fp32): the same free memory on
    # every GPU, so that both ranks run out of memory together (module docstring)
    even = equalize_gpus() if deadline and torch.cuda.is_available() else []
    trainer = loop.trainer
    rec = Recorder(trainer)

    def body() -> None:
        if bench:
            batch = bench_rollout(vocab, rows, seq)
            rec.longest = seq  # the planner's seq also when the first call runs out of memory
            for step in range(steps):
                for phase, call in (("logprobs", lambda: trainer.policy_logprobs(batch)),
                                    ("train", lambda: trainer.train_policy(
                                        batch, ClippedPGLoss(LossConfig(kl_coef=0.0))))):
                    t0 = time.perf_counter()
                    call()
                    print(f"== {name}: step {step + 1} {phase} in "
                          f"{time.perf_counter() - t0:.1f} s", flush=True)
        else:
            loop.fit()

    oom = hung = None
    try:
        done, error = run_with_deadline(body, deadline)
        if not done:
            hung = f"no answer in {deadline:.0f} s"
            stop_unanswered(name, deadline)
        elif error is not None:
            if not is_out_of_memory(error):
                raise error
            oom = " ".join(str(error).split())[-300:]
            print(f"\n== {name}: out of memory: {oom}", flush=True)
    finally:
        if not hung:  # the killed groups answer nothing: closing would wait for them
            loop.close()
        del even[:]
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
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
        if (oom or hung) and phase in seen.phases and phase in ("logprobs", "train") \
                and rec.peaks.get(phase, {}).get("max_allocated", 0) == 0:
            planned = (seen.phases[phase] - (sum(seen.engine.values()) if bench else 0)) / GIB
            table.append({"config": name, "phase": phase, "measured_alloc_gib": float("nan"),
                          "measured_reserved_gib": float("nan"), "plan_max_len_gib": planned,
                          "plan_seen_len_gib": planned, "error_pct": float("nan"),
                          "longest": rec.longest, "oom": bool(oom), "hung": bool(hung),
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
                     "longest": rec.longest, "oom": False, "hung": False,
                     "plan_fits": seen.phases[phase] <= seen.gpu_bytes})
    measured = "OUT OF MEMORY" if oom else "NO ANSWER" if hung else "ran"
    print(f"== {name}: plan {'fits' if all(r['plan_fits'] for r in table) else 'DOES NOT FIT'} "
          f"{gpu:.0f} GiB; measured {measured} [{seconds:.0f} s]", flush=True)
    for r in table:
        print(f"   {format_row(r)}", flush=True)
    return table


def format_row(r: Dict) -> str:
    """One row of the final table (``main``)."""
    alloc = ("OOM" if r["oom"] else "NO ANSWER" if r.get("hung")
             else f"{r['measured_alloc_gib']:.2f}")
    reserved = "-" if r["oom"] or r.get("hung") else f"{r['measured_reserved_gib']:.2f}"
    return (f"{r['config']:16s} {r['phase']:11s} {alloc:>7s} {reserved:>8s} "
            f"{r['plan_max_len_gib']:8.2f} {r['plan_seen_len_gib']:9.2f} "
            f"{r['error_pct']:+6.1f}% {r['longest']:7d}  "
            f"{'fits' if r['plan_fits'] else 'does not fit'}")


def equalize_gpus(slack_gib: float = 0.25) -> List[torch.Tensor]:
    """Hold memory on every visible GPU that has more than ``slack_gib`` GiB free beyond the
    least free one, so that all have the same free memory. Returns the tensors held."""
    free = [torch.cuda.mem_get_info(d)[0] for d in range(torch.cuda.device_count())]
    low, held = min(free), []
    for d, f in enumerate(free):
        if f - low > slack_gib * GIB:
            held.append(torch.empty(f - low, dtype=torch.uint8, device=f"cuda:{d}"))
    print("free after the build: " + ", ".join(
        f"GPU {d} {f / GIB:.1f} GiB" for d, f in enumerate(free))
        + f"; evened out to {low / GIB:.1f} GiB each", flush=True)
    return held


def hold_gpus_at(free_gib: float) -> List[torch.Tensor]:
    """Module docstring (``LONG_CAP_GIB``): one uint8 tensor a visible GPU leaving ``free_gib``
    GiB free on it (none where less is free already). Keep the list; dropping it (and
    ``torch.cuda.empty_cache()``) frees them."""
    held = []
    for d in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(d)
        extra = int(free - free_gib * GIB)
        if extra > 0:
            held.append(torch.empty(extra, dtype=torch.uint8, device=f"cuda:{d}"))
        print(f"GPU {d}: {total / GIB:.1f} GiB, {free / GIB:.1f} free, "
              f"{max(extra, 0) / GIB:.1f} GiB held: {torch.cuda.mem_get_info(d)[0] / GIB:.1f} "
              f"free for the jobs (LONG_CAP_GIB={free_gib:g})", flush=True)
    return held


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
    table, status, held = [], 0, None
    print("jobs: " + ", ".join(j[0] for j in jobs), flush=True)
    for name, config, overrides, bench in jobs:
        long = name.startswith("long_cp")
        if long and LONG_CAP_GIB and held is None:
            held = hold_gpus_at(LONG_CAP_GIB)
        try:
            table += measure(name, config, overrides, bench,
                             **(dict(rows=LONG_ROWS, seq=LONG_SEQ, steps=1,
                                     deadline=LONG_JOB_TIMEOUT) if long else {}))
        except Exception:  # the other configurations still run
            traceback.print_exc()
            print(f"== {name}: failed (traceback above)", flush=True)
            status = 1
    held = None
    with open(os.path.join(OUT, "memory_check.json"), "w") as f:
        json.dump(table, f, indent=2)
    print(f"\nGPU: {torch.cuda.get_device_name()}; GiB per GPU (policy worker, "
          f"max_memory_allocated / max_memory_reserved); plan at data.max_total_length and at "
          f"the longest row seen; error = plan(seen) vs allocated")
    print(f"{'config':16s} {'phase':11s} {'alloc':>7s} {'reserved':>8s} {'plan@max':>8s} "
          f"{'plan@seen':>9s} {'error':>7s} {'longest':>7s}  plan")
    for r in table:
        print(format_row(r))
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
