"""Wall time per RL step of the streaming GRPO loop against the synchronous one; prints one
markdown table.

Each mode builds a trainer of the default synthetic run (``configs/grpo_synthetic.yaml``: 32
prompts x 8 responses per step, the ~0.9M-parameter model, one policy process) with plain
processes (no Ray), skips validation and checkpoints, runs ``--steps`` RL steps and reports the
wall time per step after the first (warm-up): the time between the ends of steps, so
generation that a streaming step leaves running for the next one is counted. For the streaming
modes the per-phase split of that time is the loop's own (``timing/generation_busy_s``,
``timing/trainer_busy_s``, ``timing/overlap_s``, ``timing/idle_s``: wall seconds with
generation calls outstanding, policy calls outstanding, both, neither) and the staleness
histogram.

    python bench/streaming.py --steps 8 [--sft-steps 0] [--modes sync,stream0,stream1]
    # one GPU shared by the policy and the hf engine's process (grpo_synthetic_gpu's model),
    # 128-token responses: scripts/gpu/streaming_bench.sh
    # vLLM engines (1 by default; the sync1 mode is the sync one there):
    python bench/streaming.py --set generation.backend=vllm

No warm start by default (``--sft-steps``): the timing does not depend on the rewards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcore_rl.config.loader import load_config  # noqa: E402
from mcore_rl.controller.loops import build  # noqa: E402

# mode -> (loop, its overrides, whether the engine runs in processes of its own, the backend:
# None for the config's)
MODES = {
    "sync": ("synchronous", [], False, None),
    "sync1": ("synchronous", [], True, None),
    "sync_megatron": ("synchronous", [], False, "megatron"),
    "stream0": ("streaming, max_staleness=0", ["grpo.streaming=true", "grpo.max_staleness=0"], True,
                None),
    "stream1": ("streaming, max_staleness=1", ["grpo.streaming=true", "grpo.max_staleness=1"], True,
                None),
}
PHASES = ("generation_busy", "trainer_busy", "overlap", "idle")


def engine(backend: str, own_processes: bool) -> Tuple[str, List[str]]:
    """Where ``backend``'s engine runs in a mode, and the overrides that put it there: hf in the
    controller's process, or in 1 process of its own (``generation.num_workers=1``); vllm's
    engines always run in processes of their own (``generation.vllm.num_engines``)."""
    if backend == "hf":
        return (("hf in 1 process of its own", ["generation.num_workers=1"]) if own_processes
                else ("hf in the controller's process", []))
    if backend == "vllm":
        return "vllm, 1 engine", []
    return f"{backend} in the policy's processes", [f"generation.backend={backend}"]


def mode_overrides(backend: str, mode: str) -> Tuple[str, List[str]]:
    """A mode's label and overrides for ``backend``."""
    loop, overrides, own, mode_backend = MODES[mode]
    where, placed = engine(mode_backend or backend, own)
    return f"{loop}, {where}", overrides + placed


def bench(config: str, overrides: List[str], steps: int, sft_steps: int,
          out: str) -> Dict[str, float]:
    """Seconds per RL step (after the first) of ``config`` with ``overrides`` (a mode's
    included), and the streaming loop's phases."""
    cfg = load_config(config, overrides + [
        "cluster.use_ray=false", f"sft.steps={sft_steps}", f"grpo.max_steps={steps}",
        "grpo.val_every=0", "grpo.val_at_start=false", "checkpoint.save_final=false",
        "logging.progress=false", f"run.output_dir={out}"])
    loop = build(cfg)
    try:
        loop.refit()
        ends: List[float] = []
        metrics = []
        for _ in range(steps):
            metrics.append(loop.rl_step())
            loop.trainer.step += 1
            ends.append(time.perf_counter())
    finally:
        loop.close()
    per_step = [b - a for a, b in zip(ends[:-1], ends[1:])]
    row = {"mean": statistics.mean(per_step), "median": statistics.median(per_step)}
    for p in PHASES:
        if f"timing/{p}_s" in metrics[-1]:
            row[p] = statistics.mean(m[f"timing/{p}_s"] for m in metrics[1:])
    stale = [k for k in metrics[-1] if k.startswith("stream/staleness_") and k[-1].isdigit()]
    if stale:
        row["staleness"] = " / ".join(f"{sum(m[k] for m in metrics[1:]):g}" for k in sorted(stale))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sft-steps", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--config", default="grpo_synthetic")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides of every mode")
    parser.add_argument("--stream-set", nargs="*", default=[],
                        help="config overrides of the streaming modes only")
    args = parser.parse_args()
    backend = load_config(args.config, args.set).generation.backend
    rows, labels, runs = {}, {}, {}
    for mode in args.modes.split(","):
        labels[mode], overrides = mode_overrides(backend, mode)
        if mode.startswith("stream"):
            overrides += args.stream_set
        if overrides not in runs.values():  # vllm: sync and sync1 are one run
            runs[mode] = overrides
    with tempfile.TemporaryDirectory() as tmp:
        for mode, overrides in runs.items():
            rows[mode] = bench(args.config, args.set + overrides, args.steps, args.sft_steps,
                               os.path.join(tmp, mode))
            print(f"{mode}: {rows[mode]}", file=sys.stderr, flush=True)
    # the baseline: the first synchronous mode run (sync, sync1: the engine in its own process)
    base = next((r["mean"] for m, r in rows.items() if m.startswith("sync")), None)
    print(f"{args.config} {' '.join(args.set)} (streaming modes: {' '.join(args.stream_set)}): "
          f"{args.steps} RL steps per mode (the first not "
          f"counted), load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end\n")
    print("| loop | s/step mean | median | vs sync | generation busy | trainer busy | overlap "
          "| idle | groups at staleness 0 / 1 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for mode, r in rows.items():
        phases = " | ".join(f"{r[p]:.2f}" if p in r else "" for p in PHASES)
        rel = f"{r['mean'] / base:.2f}x" if base else ""
        print(f"| {labels[mode]} | {r['mean']:.2f} | {r['median']:.2f} | {rel} | {phases} | "
              f"{r.get('staleness', '')} |")


if __name__ == "__main__":
    main()
