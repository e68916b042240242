"""An 8B-shape GRPO run on one node (configs/grpo_llama8b.yaml by default), measured step by step;
prints a table last and writes ``$OUT/<name>.json``.

The trainer is built as ``mcore-rl train`` builds it (``controller.loops.build``, no Ray) and
runs ``--steps`` RL steps (``Loop.fit``). Measured:

- per step: seconds of the step and of its phases (generation, refit, logprobs, train, reward),
  ``perf/tokens_per_s_per_gpu`` (NeMo RL's Tokens/sec/GPU: the step's prompt + response tokens
  / step seconds / GPUs), the response length, the refit's GB and seconds,
  ``train/token_mult_prob_error`` (trainer vs engine logprobs of the step's rollout);
- memory per phase: the policy workers' ``torch.cuda.max_memory_allocated`` (reset before each
  of the phase's calls, the largest over calls and ranks) against the planner's prediction for
  the policy's process (:func:`mcore_rl.megatron.memory.plan_memory` at the longest row seen,
  without the rollout engine's share, which lives in the engines' processes), and the GPUs'
  used memory (NVML, every process, sampled every 0.1 s; the largest over the phase's windows
  and GPUs) against the whole predicted phase, and each process's own peak on GPU 0 in each
  phase (NVML's per-process used memory, named by its command line: the policy rank, the
  vLLM engine's worker), which splits the GPU's figure into the planner's terms.

Usage (one device call; carry the wheels as scripts/gpu/env.sh expects, vLLM installed into
/tmp/site by ``session.sh vllm``):

    python3 scripts/gpu/llama8b.py --name llama8b_colocated --steps 10 \\
        --set model.tokenizer=/tmp/tok data.train_path=/tmp/gsm8k/train.jsonl ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.config.loader import load_config  # noqa: E402
from mcore_rl.controller.loops import build  # noqa: E402
from mcore_rl.megatron import memory  # noqa: E402
from mcore_rl.planning import resolve_arch  # noqa: E402
from mcore_rl.workers.interfaces import PolicyAPI  # noqa: E402

GIB = 2.0**30
OUT = os.environ.get("OUT", "/tmp/mcore_rl_out")
PHASES = ("generation", "refit", "logprobs", "train")
COMMON = ["cluster.use_ray=false", "logging.progress=false", "logging.tensorboard=false",
          "checkpoint.every=0", "checkpoint.save_final=false"]


class GPUSampler(threading.Thread):
    """Used memory of every GPU (NVML: all processes) every ``period`` seconds."""

    def __init__(self, period: float = 0.1):
        super().__init__(daemon=True)
        try:  # nvidia-ml-py; without it (a CPU check of this script) nothing is sampled
            import pynvml

            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                            for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            pynvml, self.handles = None, []
        self.nvml = pynvml
        self.period = period
        self.samples: List[Tuple[float, List[int]]] = []
        self.procs: List[Tuple[float, Dict[int, int]]] = []  # GPU 0: pid -> used bytes
        self.stop = threading.Event()

    def run(self) -> None:
        while self.handles and not self.stop.is_set():
            used = [self.nvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]
            t = time.perf_counter()
            self.samples.append((t, used))
            try:
                running = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handles[0])
                self.procs.append((t, {p.pid: p.usedGpuMemory or 0 for p in running}))
            except Exception:  # a driver or container that hides processes: GPU totals only
                pass
            time.sleep(self.period)

    def process_peaks(self, windows: List[Tuple[float, float]]) -> List[Tuple[str, float]]:
        """Each process's largest used GiB on GPU 0 within ``windows``, named by its command
        line (pid: first 60 characters), largest first."""
        best: Dict[int, int] = {}
        for t, used in self.procs:
            if any(a <= t <= b for a, b in windows):
                for pid, b in used.items():
                    best[pid] = max(best.get(pid, 0), b)
        return sorted(((f"{pid}: {_cmdline(pid)}", b / GIB) for pid, b in best.items()),
                      key=lambda x: -x[1])

    def peak(self, windows: List[Tuple[float, float]]) -> int:
        """The largest used bytes of any GPU within ``windows``."""
        best = 0
        for t, used in self.samples:
            if any(a <= t <= b for a, b in windows):
                best = max(best, max(used))
        return best


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:60].strip()
    except OSError:
        return "?"


class Recorder:
    """Phase windows (from the trainer's phase timer) and the policy's peak allocations per
    phase (its workers' ``memory_stats``, reset at the start of each phase)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.windows: Dict[str, List[Tuple[float, float]]] = {}
        self.peaks: Dict[str, int] = {}
        self.longest = self.longest_prompt = 0
        timer = trainer.timer
        inner = timer.phase

        @contextlib.contextmanager
        def phase(name):
            if name in PHASES:
                self._stats(True)
            start = time.perf_counter()
            with inner(name):
                yield
            self.windows.setdefault(name, []).append((start, time.perf_counter()))
            if name in PHASES:
                peak = max(s["max_allocated"] for s in self._stats(False))
                self.peaks[name] = max(self.peaks.get(name, 0), peak)

        timer.phase = phase
        # the rollouts' lengths, whichever way the producer makes them (with
        # reward.score_while_decoding it returns (rollout, pending rewards))
        for name in ("generate", "generate_scored"):
            setattr(trainer.producer, name, self._lengths(getattr(trainer.producer, name)))

    def _lengths(self, fn):
        def generated(*args, **kwargs):
            out = fn(*args, **kwargs)
            rollout = out[0] if isinstance(out, tuple) else out
            self.longest = max(self.longest, int(rollout["input_lengths"].max()))
            self.longest_prompt = max(self.longest_prompt, int(rollout["prompt_lengths"].max()))
            return out

        return generated

    def _stats(self, reset: bool) -> List[Dict[str, int]]:
        return self.trainer.policy.call(PolicyAPI).memory_stats(reset)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="grpo_llama8b")
    p.add_argument("--name", default="llama8b")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the medians")
    p.add_argument("--set", nargs="*", default=[], help="config overrides")
    args = p.parse_args()
    os.makedirs(OUT, exist_ok=True)
    run_dir = f"/tmp/runs/{args.name}"
    overrides = COMMON + [f"grpo.max_steps={args.steps}", f"run.output_dir={run_dir}"] + args.set
    cfg = load_config(args.config, overrides)
    arch, vocab = resolve_arch(cfg)
    sampler = GPUSampler()
    sampler.start()
    t0 = time.perf_counter()
    loop = build(cfg)
    built = time.perf_counter() - t0
    print(f"== {args.name}: built in {built:.0f} s ({memory.model_parameters(arch, vocab) / 1e9:.2f}B "
          f"parameters, {loop.trainer.placement.plan.num_gpus} GPUs)", flush=True)
    rec = Recorder(loop.trainer)
    try:
        loop.fit()
    finally:
        loop.close()
        sampler.stop.set()
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    plan = memory.plan_memory(cfg, arch, vocab, seq=rec.longest or None,
                              prompt=rec.longest_prompt or None)
    engine_elsewhere = (sum(plan.engine.values()) if cfg.generation.backend == "vllm" else 0)
    mem = []
    for phase in PHASES:
        if phase not in rec.windows:
            continue
        predicted_total = plan.phases.get(phase)
        if phase == "refit":  # the train state is off the GPU, the weights on it, engines awake
            predicted_total = None
        predicted_policy = None if predicted_total is None else predicted_total - (
            engine_elsewhere if phase == "generation" else 0)
        if phase == "generation" and plan.engine_offloaded and cfg.generation.backend == "vllm":
            predicted_policy = predicted_total - engine_elsewhere
        mem.append({"phase": phase, "policy_alloc_gib": rec.peaks.get(phase, 0) / GIB,
                    "policy_plan_gib": None if predicted_policy is None else predicted_policy / GIB,
                    "gpu_used_gib": sampler.peak(rec.windows[phase]) / GIB,
                    "gpu_plan_gib": None if predicted_total is None else predicted_total / GIB,
                    "gpu0_processes": sampler.process_peaks(rec.windows[phase])})
    keys = ["timing/step_s", "timing/generation_s", "timing/refit_s", "timing/logprobs_s",
            "timing/train_s", "perf/tokens_per_s_per_gpu", "train/response_length",
            "train/num_tokens", "refit/seconds", "refit/gbytes", "train/token_mult_prob_error",
            "refit/offload_train_s", "refit/wake_weights_s", "refit/transfer_s",
            "refit/offload_weights_s", "refit/wake_kv_s"]
    timed = rows[args.warmup:] or rows

    def median(k):
        vals = sorted(r[k] for r in timed if k in r)
        return vals[len(vals) // 2] if vals else float("nan")

    result = {"name": args.name, "config": args.config, "overrides": args.set,
              "built_s": built, "steps": rows, "median": {k: median(k) for k in keys},
              "memory": mem, "longest": rec.longest, "plan": memory.format_plan(plan)}
    with open(os.path.join(OUT, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(memory.format_plan(plan))
    print(f"\n== {args.name}: per step (s) and tokens/s/GPU; medians of steps > {args.warmup}")
    print(f"{'step':>4} {'step_s':>7} {'gen':>6} {'refit':>6} {'lp':>6} {'train':>6} "
          f"{'tok/s/GPU':>9} {'resp':>5} {'mult_err':>8}")
    for r in rows:
        print(f"{r['step']:4d} {r.get('timing/step_s', 0):7.2f} {r.get('timing/generation_s', 0):6.2f} "
              f"{r.get('timing/refit_s', 0):6.2f} {r.get('timing/logprobs_s', 0):6.2f} "
              f"{r.get('timing/train_s', 0):6.2f} {r.get('perf/tokens_per_s_per_gpu', 0):9.0f} "
              f"{r.get('train/response_length', 0):5.0f} "
              f"{r.get('train/token_mult_prob_error', float('nan')):8.4f}")
    m = result["median"]
    print(f" med {m['timing/step_s']:7.2f} {m['timing/generation_s']:6.2f} {m['timing/refit_s']:6.2f} "
          f"{m['timing/logprobs_s']:6.2f} {m['timing/train_s']:6.2f} "
          f"{m['perf/tokens_per_s_per_gpu']:9.0f}  refit {m['refit/seconds']:.2f} s for "
          f"{m['refit/gbytes']:.1f} GB")
    parts = [k for k in keys if k.startswith("refit/") and k.endswith("_s") and m[k] == m[k]]
    if parts:
        print("  refit hand-overs (medians, s): " + ", ".join(
            f"{k.split('/')[1][:-2]} {m[k]:.2f}" for k in parts))
    print(f"\n== {args.name}: memory per phase, GiB (policy: max_memory_allocated of its process vs "
          f"plan; GPU: NVML used, every process, vs the whole plan)")
    for r in mem:
        pp = "-" if r["policy_plan_gib"] is None else f"{r['policy_plan_gib']:.1f}"
        gp = "-" if r["gpu_plan_gib"] is None else f"{r['gpu_plan_gib']:.1f}"
        print(f"{r['phase']:>10} policy {r['policy_alloc_gib']:6.1f} plan {pp:>6}   "
              f"GPU {r['gpu_used_gib']:6.1f} plan {gp:>6}")
        for name, gib in r["gpu0_processes"]:
            print(f"{'':>12}GPU 0 process {gib:6.2f} GiB  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
