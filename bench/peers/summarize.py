"""Figures of the peer benchmark (bench/peers/).

``summarize.py mcore-rl METRICS_JSONL --json OUT.json``: median seconds per RL step over the
steps after the first ``--warmup`` (``timing/step_s`` of each step in the run's metrics.jsonl)
and tokens per second (prompt + response tokens of the step, ``train/num_tokens``, and
response tokens alone, per second of that step; medians over the same steps).

``summarize.py phases A.json B.json ...``: median seconds of the step and of each phase of
mcore-rl results (``--mode`` labels each run).

``summarize.py table A.json B.json ...``: one row per result (mcore-rl's and TRL's JSON
files, as bench/peers/trl_grpo.py writes them), with each peer's seconds per step over
mcore-rl's (the ratio: how many times faster mcore-rl is); missing files are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def mcore_rl(metrics_path: str, warmup: int, command: str, rollouts: int = 256,
             mode: str = "megatron") -> dict:
    """The mcore-rl result dict from a run's metrics.jsonl (rows with ``timing/step_s``);
    ``rollouts`` per step (prompts x generations) turn the mean response length into the
    step's response tokens.

    Raises:
        ValueError: no more than ``warmup`` RL steps in the file.
    """
    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    rows = [r for r in rows if "timing/step_s" in r]
    if len(rows) <= warmup:
        raise ValueError(f"{metrics_path}: {len(rows)} RL steps, need more than {warmup}")
    steps = rows[warmup:]
    step_s = [r["timing/step_s"] for r in rows]
    phases = sorted({k for r in steps for k in r if k.startswith("timing/")})
    return {
        "peer": "mcore-rl", "mode": mode, "steps": len(rows), "warmup": warmup,
        "seconds_per_step_median": statistics.median(r["timing/step_s"] for r in steps),
        "seconds_per_step": step_s,
        "tokens_per_s_median": statistics.median(r["train/num_tokens"] / r["timing/step_s"]
                                                 for r in steps),
        "completion_tokens_per_s_median": statistics.median(
            r["train/response_length"] * rollouts / r["timing/step_s"] for r in steps),
        "phase_seconds_median": {k[len("timing/"):-len("_s")]: statistics.median(
            r.get(k, 0.0) for r in steps) for k in phases},
        "reward_mean": [r.get("train/reward_mean") for r in rows],
        "command": command,
    }


def table(paths) -> str:
    results = []
    for p in paths:
        if os.path.exists(p):
            results.append(json.load(open(p)))
        else:
            print(f"(no {p})", file=sys.stderr)
    ours = next((r for r in results if r["peer"] == "mcore-rl"), None)
    lines = [f"{'peer':<14}{'mode':<10}{'s/step (median)':>17}{'tokens/s':>11}"
             f"{'completion tok/s':>18}{'x mcore-rl':>12}"]
    for r in results:
        ratio = (r["seconds_per_step_median"] / ours["seconds_per_step_median"]
                 if ours else float("nan"))
        name = r["peer"] + (" " + r["trl_version"] if "trl_version" in r else "")
        comp = r.get("completion_tokens_per_s_median")
        lines.append(f"{name:<14}{r['mode']:<10}{r['seconds_per_step_median']:>17.2f}"
                     f"{r['tokens_per_s_median']:>11.0f}"
                     f"{(f'{comp:.0f}' if comp is not None else '-'):>18}{ratio:>12.2f}")
    lines.append("x mcore-rl: the peer's seconds per step over mcore-rl's (> 1: mcore-rl faster)")
    return "\n".join(lines)


def phases(paths) -> str:
    """One row per mcore-rl result: median seconds of the step and of each phase."""
    results = [json.load(open(p)) for p in paths if os.path.exists(p)]
    results = [r for r in results if "phase_seconds_median" in r]
    names = ["step"] + sorted({k for r in results for k in r["phase_seconds_median"]} - {"step"})
    lines = [f"{'run':<24}" + "".join(f"{n[:11]:>12}" for n in names)]
    for r in results:
        lines.append(f"{r['mode'][:23]:<24}" + "".join(
            f"{r['phase_seconds_median'].get(n, 0.0):>12.3f}" for n in names))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("mcore-rl")
    m.add_argument("metrics")
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--command", default="")
    m.add_argument("--rollouts", type=int, default=256, help="prompts x generations per step")
    m.add_argument("--json", required=True)
    m.add_argument("--mode", default="megatron", help="the run's label in the tables")
    t = sub.add_parser("table")
    t.add_argument("results", nargs="+")
    ph = sub.add_parser("phases", help="median seconds per phase of mcore-rl results")
    ph.add_argument("results", nargs="+")
    a = p.parse_args(argv)
    if a.what == "mcore-rl":
        result = mcore_rl(a.metrics, a.warmup, a.command, a.rollouts, a.mode)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.json}: {result['seconds_per_step_median']:.2f} s per step (median)")
    elif a.what == "phases":
        print(phases(a.results))
    else:
        print(table(a.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
