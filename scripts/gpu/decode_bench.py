"""Megatron rollouts before and after CUDA-graph decoding (issue 13), in one device call.

Runs, one at a time on one GPU, each in its own processes:

- ``gen``: scripts/gpu/megatron_generation.py (parity, same-seed and offload-guard checks,
  ``--skip-hf``) on this checkout and, with ``--base``, on a checkout of the code before (the
  script of this checkout is copied into it, so both take the same measurement), at the issue's
  shapes (``--shapes``): 256 rollouts x 512 new tokens in one chunk of 256, and 64 x 256 in one
  chunk of 64 (the script's defaults); on this checkout with ``--eager-check 64`` (CUDA graphs
  vs eager decoding, greedy, token for token) at the first shape given.
- ``main``: the GPU main job (configs/grpo_synthetic_gpu.yaml, ``grpo.max_steps`` from
  ``--main-steps``) on this checkout and on ``--base``: per-phase seconds per RL step and
  held-out accuracy.

Logs go to ``$OUT`` (default /tmp/mcore_rl_out); the tables are printed last. Run after
``source scripts/gpu/env.sh`` (the carried wheels):

    python3 scripts/gpu/decode_bench.py [--base ../base] [--parts gen main] [--shapes 256x512]
        [--main-steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.environ.get("OUT", "/tmp/mcore_rl_out")
GEN = {"256x512": ["--rollouts", "256", "--batch-size", "256", "--prompt-length", "64", "128",
                   "--max-new-tokens", "512"],
       "64x256": ["--rollouts", "64", "--batch-size", "64", "--prompt-length", "32", "128",
                  "--max-new-tokens", "256"]}
PHASES = ("step", "generation", "train", "logprobs", "refit", "validation", "reward")


def _run(cmd, cwd: str, log: str, timeout: int) -> str:
    """Run ``cmd`` in ``cwd`` with that checkout first on PYTHONPATH; its output to ``log``
    (under OUT) and returned."""
    env = dict(os.environ, PYTHONPATH=f"/tmp/site:{cwd}")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        text, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        text, rc = out.decode() if isinstance(out, bytes) else out, "timeout"
    with open(os.path.join(OUT, log), "w") as f:
        f.write(text)
    print(f"== {log}: rc {rc}, {time.perf_counter() - start:.0f} s", flush=True)
    for line in text.splitlines():
        if line.startswith(("PASS", "FAIL", "decode:", "Traceback", "RuntimeError", "torch ")) \
                or "Error" in line[:40]:
            print("   " + line[:220], flush=True)
    return text


def _result(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else {}


def gen(base: Optional[str], shapes: List[str]) -> dict:
    script = "scripts/gpu/megatron_generation.py"
    if base:
        shutil.copy(os.path.join(HERE, script),
                    os.path.join(base, "scripts/gpu/megatron_generation_now.py"))
    out = {}
    for name in shapes:
        extra = ["--eager-check", "64"] if name == shapes[0] else []
        new = _run(["python3", script, "--skip-hf", *GEN[name], *extra], HERE,
                   f"gen_{name}_new.log", 280)
        if not _result(new):  # this checkout failed: no use timing the base
            raise SystemExit(f"{script} failed on this checkout ({name}); see {OUT}/gen_{name}_new.log")
        old = _run(["python3", "scripts/gpu/megatron_generation_now.py", "--skip-hf", *GEN[name]],
                   base, f"gen_{name}_base.log", 280) if base else ""
        out[name] = {"base": _result(old), "new": _result(new)}
    return out


def main_job(base: Optional[str], steps: int) -> dict:
    out = {"base": {}}
    for which, root in (("new", HERE), ("base", base)):
        if root is None:
            continue
        run_dir = f"/tmp/runs/main_{which}"
        _run(["python3", "-m", "mcore_rl", "train", "--config-name", "grpo_synthetic_gpu",
              "cluster.use_ray=false", "logging.progress=false", "logging.tensorboard=false",
              f"grpo.max_steps={steps}", f"run.output_dir={run_dir}"], root, f"main_{which}.log", 420)
        path = os.path.join(run_dir, "summary.json")
        out[which] = json.load(open(path)) if os.path.exists(path) else {}
        if os.path.exists(path):
            shutil.copy(path, os.path.join(OUT, f"main_{which}_summary.json"))
    return out


def _tables(results: dict) -> None:
    if "gen" in results:
        print("\n| shape (rollouts x new tokens, one chunk) | before tok/s | after tok/s | speed-up "
              "| after: logprob max / mean abs diff | same seed | eager = graphs |")
        print("| --- | ---: | ---: | ---: | --- | --- | --- |")
        for name, r in results["gen"].items():
            b, n = r["base"].get("tokens_per_s"), r["new"].get("tokens_per_s")
            ratio = f"{n / b:.2f}x" if b and n else "-"
            eager = r["new"].get("eager_rows_differ")
            print(f"| {name} | {b or '-'} | {n} | {ratio} | {r['new'].get('max_abs')} / "
                  f"{r['new'].get('mean_abs')} | {r['new'].get('same_seed')} | "
                  f"{'-' if eager is None else eager == 0} |")
    if "main" in results:
        m = results["main"]
        print("\n| grpo_synthetic_gpu, s per RL step | before | after |")
        print("| --- | ---: | ---: |")
        for phase in PHASES:
            cells = [m[w].get("seconds_per_step", {}).get(phase) for w in ("base", "new")]
            print(f"| {phase} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
        for w in ("base", "new"):
            print(f"held-out accuracy ({w}): {m[w].get('val_curve')}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="checkout of the code before (none: this checkout alone)")
    p.add_argument("--parts", nargs="+", default=["gen", "main"], choices=["gen", "main"])
    p.add_argument("--shapes", nargs="+", default=list(GEN), choices=list(GEN),
                   help="gen shapes; the eager check runs at the first")
    p.add_argument("--main-steps", type=int, default=40)
    args = p.parse_args()
    base = os.path.abspath(args.base) if args.base else None
    os.makedirs(OUT, exist_ok=True)
    results = {}
    if "gen" in args.parts:
        results["gen"] = gen(base, args.shapes)
    if "main" in args.parts:
        results["main"] = main_job(base, args.main_steps)
    with open(os.path.join(OUT, "decode_bench.json"), "w") as f:
        json.dump(results, f, indent=1)
    _tables(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
