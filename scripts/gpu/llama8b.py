"""An 8B-shape GRPO run on one node (configs/grpo_llama8b.yaml by default), measured step by step;
prints a table last and writes ``$OUT/<name>.json``.

The trainer is built as ``mcore-rl train`` builds it (``controller.loops.build``, no Ray) and
runs ``--steps`` RL steps (``Loop.fit``). Measured:

- per step: seconds of the step and of its phases (generation, refit, logprobs, train, reward),
  ``perf/tokens_per_s_per_gpu`` (NeMo RL's Tokens/sec/GPU: the step's prompt + response tokens
  / step seconds / GPUs), the response length, the refit's seconds and GB (``refit/gbytes``:
  what each engine worker receives, the policy's full tensors; ``refit/gbytes_sent``: the
  policy ranks' sends summed, four copies over CUDA IPC from four ranks, one NCCL broadcast),
  ``train/token_mult_prob_error`` (trainer vs engine logprobs of the step's rollout);
- memory per phase: the policy workers' ``torch.cuda.max_memory_allocated`` (reset at the
  start of the phase, the largest over its repeats and the ranks) against the planner's
  prediction for the policy's process (:func:`mcore_rl.megatron.memory.plan_memory` at the
  longest row seen, without the vLLM engines' share, which lives in their processes), and the
  policy's GPUs' used memory (NVML, every process, sampled every 0.1 s; the largest over the
  phase's windows and those GPUs) against the whole predicted phase, and each process's own
  peak on GPU 0 in each phase (NVML's per-process used memory, named by its command line: the
  policy rank, the vLLM engine's worker), which splits the GPU's figure into the planner's
  terms. A phase the plan says the run never enters (``logprobs`` under
  ``loss.prev_logprobs=train_forward``: the synchronous loop's logprobs phase is then empty)
  gets the plan's reason, no figures. The streaming loop has no train phase of its own (its
  logprob forwards and training micro-batches overlap generation): its ``train`` is the
  policy's peak from the start of each RL step to the end of its optimizer step (``finish``).

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
from typing import Any, Dict, List, Optional, Tuple

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

    def peak(self, windows: List[Tuple[float, float]], gpus: Optional[List[int]] = None) -> int:
        """The largest used bytes of the GPUs ``gpus`` (None: every GPU) within ``windows``."""
        best = 0
        for t, used in self.samples:
            if any(a <= t <= b for a, b in windows):
                best = max([best, *(u for i, u in enumerate(used) if gpus is None or i in gpus)])
        return best


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:60].strip()
    except OSError:
        return "?"


class Recorder:
    """Phase windows (from the trainer's phase timer) and the policy's peak allocations per
    phase (its workers' ``memory_stats``, reset at the start of each phase). With
    :meth:`stream`, the streaming loop's ``train`` too."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.windows: Dict[str, List[Tuple[float, float]]] = {}
        self.peaks: Dict[str, int] = {}
        self.longest = self.longest_prompt = 0
        self.step_start: Optional[float] = None  # of the streaming loop's RL step
        timer = trainer.timer
        inner = timer.phase

        @contextlib.contextmanager
        def phase(name):
            if name in PHASES:
                self._stats(True)
            start = time.perf_counter()
            with inner(name):
                yield
            if name in PHASES:
                self._record(name, start)
            elif name == "finish" and self.step_start is not None:
                self._record("train", self.step_start)  # the streamed step's optimizer step
                self.step_start = None
            else:
                self.windows.setdefault(name, []).append((start, time.perf_counter()))

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

    def stream(self, loop) -> None:
        """For the streaming loop (``<algorithm>.streaming``): each RL step resets the policy's
        peaks at its start; the end of its ``finish`` phase (the optimizer steps) records the
        peak since as ``train``: the chunks' logprob forwards and training micro-batches, which
        run overlapped with generation in no phase of their own, and the optimizer step (the
        plan's ``train`` phase counts all three; its ``logprobs`` is the smaller). The refit
        after it is its own phase, as in the synchronous loop. Two ``memory_stats`` calls a
        step."""
        inner = loop.rl_step

        def rl_step():
            self._stats(True)
            self.step_start = time.perf_counter()
            return inner()

        loop.rl_step = rl_step

    def _record(self, name: str, start: float) -> None:
        """Phase ``name`` ran from ``start`` to now: its window, and the policy's peak since
        the last reset (the largest over its ranks and the phase's repeats)."""
        self.windows.setdefault(name, []).append((start, time.perf_counter()))
        peak = max(s["max_allocated"] for s in self._stats(False))
        self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def _stats(self, reset: bool) -> List[Dict[str, int]]:
        return self.trainer.policy.call(PolicyAPI).memory_stats(reset)


def memory_rows(plan: memory.MemoryPlan, backend: str, peaks: Dict[str, int],
                windows: Dict[str, List[Tuple[float, float]]], sampler: Any,
                gpus: Optional[List[int]] = None, streaming: bool = False) -> List[Dict[str, Any]]:
    """One row per phase of :data:`PHASES` that ran (has a window) or that the plan says the
    run never enters (``plan.not_run``: the phase and the reason only): the policy's peak
    allocation (``peaks``, bytes) against the plan's phase less what lives in other processes
    (the vLLM engines' share, where the phase counts it: generation, or every phase when the
    engines stay awake), and the peak NVML use of the policy's GPUs ``gpus`` (``sampler``:
    :class:`GPUSampler`) against the whole phase, with GPU 0's processes. The refit is not
    planned (the training state leaves the GPU while the engines wake). ``streaming``: the
    ``train`` row is the streamed step's (:meth:`Recorder.stream`), so noted."""
    elsewhere = sum(plan.engine.values()) if backend == "vllm" else 0
    rows = []
    for phase in PHASES:
        if phase in plan.not_run:
            rows.append({"phase": phase, "not_run": plan.not_run[phase]})
            continue
        if phase not in windows:
            continue
        total = None if phase == "refit" else plan.phases.get(phase)
        counted = phase == "generation" or not plan.engine_offloaded  # the engines' share
        policy = None if total is None else total - (elsewhere if counted else 0)
        row = {"phase": phase, "policy_alloc_gib": peaks.get(phase, 0) / GIB,
               "policy_plan_gib": None if policy is None else policy / GIB,
               "gpu_used_gib": sampler.peak(windows[phase], gpus) / GIB,
               "gpu_plan_gib": None if total is None else total / GIB,
               "gpu0_processes": sampler.process_peaks(windows[phase])}
        if streaming and phase == "train":
            row["note"] = "the streamed step: logprob forwards, micro-batches, optimizer step"
        rows.append(row)
    return rows


def refit_line(median: Dict[str, float], engine_workers: Optional[int]) -> str:
    """The medians' refit: its seconds and GB each engine worker receives (``refit/gbytes``),
    with the GB the policy's ranks sent in all (``refit/gbytes_sent``) when known; shared
    weights (0 GB) say so."""
    seconds, gb = median["refit/seconds"], median["refit/gbytes"]
    if gb == 0:
        return f"refit {seconds:.2f} s: weights shared in place, nothing sent"
    workers = f"of {engine_workers} engine workers" if engine_workers else "engine worker"
    line = f"refit {seconds:.2f} s: {gb:.1f} GB to each {workers}"
    sent = median.get("refit/gbytes_sent", float("nan"))
    if sent == sent:
        line += f", {sent:.1f} GB sent by the policy's ranks in all"
    return line


def format_summary(result: Dict[str, Any]) -> str:
    """The tables of a run's result (what ``main`` writes to ``$OUT/<name>.json``): the plan,
    the per-step seconds and tokens/s/GPU with their medians and the refit, the refit's
    hand-overs, and memory per phase against the plan (:func:`memory_rows`)."""
    name, rows, m = result["name"], result["steps"], result["median"]
    lines = [result["plan"], "",
             f"== {name}: per step (s) and tokens/s/GPU; medians of steps > {result['warmup']}",
             f"{'step':>4} {'step_s':>7} {'gen':>6} {'refit':>6} {'lp':>6} {'train':>6} "
             f"{'tok/s/GPU':>9} {'resp':>5} {'mult_err':>8}"]
    for r in rows:
        lines.append(
            f"{r['step']:4d} {r.get('timing/step_s', 0):7.2f} {r.get('timing/generation_s', 0):6.2f} "
            f"{r.get('timing/refit_s', 0):6.2f} {r.get('timing/logprobs_s', 0):6.2f} "
            f"{r.get('timing/train_s', 0):6.2f} {r.get('perf/tokens_per_s_per_gpu', 0):9.0f} "
            f"{r.get('train/response_length', 0):5.0f} "
            f"{r.get('train/token_mult_prob_error', float('nan')):8.4f}")
    lines.append(
        f" med {m['timing/step_s']:7.2f} {m['timing/generation_s']:6.2f} {m['timing/refit_s']:6.2f} "
        f"{m['timing/logprobs_s']:6.2f} {m['timing/train_s']:6.2f} "
        f"{m['perf/tokens_per_s_per_gpu']:9.0f}  {refit_line(m, result.get('engine_workers'))}")
    parts = [k for k in m if k.startswith("refit/") and k.endswith("_s") and m[k] == m[k]]
    if parts:
        lines.append("  refit hand-overs (medians, s): " + ", ".join(
            f"{k.split('/')[1][:-2]} {m[k]:.2f}" for k in parts))
    lines += ["", f"== {name}: memory per phase, GiB (policy: max_memory_allocated of its process "
                  f"vs plan; GPU: NVML used on the policy's GPUs, every process, vs the whole plan)"]
    for r in result["memory"]:
        if "not_run" in r:
            lines.append(f"{r['phase']:>10} not run: {r['not_run']}")
            continue
        pp = "-" if r["policy_plan_gib"] is None else f"{r['policy_plan_gib']:.1f}"
        gp = "-" if r["gpu_plan_gib"] is None else f"{r['gpu_plan_gib']:.1f}"
        note = f"   ({r['note']})" if r.get("note") else ""
        lines.append(f"{r['phase']:>10} policy {r['policy_alloc_gib']:6.1f} plan {pp:>6}   "
                     f"GPU {r['gpu_used_gib']:6.1f} plan {gp:>6}{note}")
        for proc, gib in r["gpu0_processes"]:
            lines.append(f"{'':>12}GPU 0 process {gib:6.2f} GiB  {proc}")
    return "\n".join(lines)


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
    streaming = bool(getattr(getattr(cfg, cfg.algorithm), "streaming", False))
    if streaming:
        rec.stream(loop)
    placement = loop.trainer.placement.plan
    policy_gpus = sorted({placement.gpu_index("policy", r) for r in range(cfg.cluster.num_workers)})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if all(v.isdigit() for v in visible):  # NVML counts every GPU, CUDA the visible ones
        policy_gpus = [int(visible[i]) for i in policy_gpus]
    try:
        loop.fit()
    finally:
        loop.close()
        sampler.stop.set()
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    plan = memory.plan_memory(cfg, arch, vocab, seq=rec.longest or None,
                              prompt=rec.longest_prompt or None)
    mem = memory_rows(plan, cfg.generation.backend, rec.peaks, rec.windows, sampler, policy_gpus,
                      streaming)
    keys = ["timing/step_s", "timing/generation_s", "timing/refit_s", "timing/logprobs_s",
            "timing/train_s", "perf/tokens_per_s_per_gpu", "train/response_length",
            "train/num_tokens", "refit/seconds", "refit/gbytes", "refit/gbytes_sent",
            "train/token_mult_prob_error", "refit/offload_train_s", "refit/wake_weights_s",
            "refit/transfer_s", "refit/offload_weights_s", "refit/wake_kv_s"]
    timed = rows[args.warmup:] or rows

    def median(k):
        vals = sorted(r[k] for r in timed if k in r)
        return vals[len(vals) // 2] if vals else float("nan")

    v = cfg.generation.vllm
    result = {"name": args.name, "config": args.config, "overrides": args.set,
              "built_s": built, "steps": rows, "median": {k: median(k) for k in keys},
              "warmup": args.warmup, "memory": mem, "longest": rec.longest,
              "engine_workers": (v.num_engines * v.tensor_parallel_size
                                 if cfg.generation.backend == "vllm" else None),
              "plan": memory.format_plan(plan)}
    with open(os.path.join(OUT, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(format_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
