"""Held-out accuracy of the algorithm configs on the synthetic task, as a markdown table.

Reads the ``metrics.jsonl`` of finished runs (one per config: ``grpo_synthetic``,
``dapo_synthetic``, ...) and prints, per run, the validation accuracy at the steps it was
measured, the mean generation rounds per step (above 1 only with DAPO's dynamic sampling: the
extra rollouts it generated) and the last step's train reward. The runs are made with
``mcore-rl train --config-name <config> grpo.val_every=50 ...`` (bench/RESULTS.md gives the
exact commands)::

    python bench/algorithms_learning.py /tmp/algo_runs/grpo_synthetic /tmp/algo_runs/dapo_synthetic
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List


def _records(run_dir: Path) -> List[Dict[str, float]]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _accuracy(run_dir: Path, records: List[Dict[str, float]]) -> Dict[int, float]:
    """Validation accuracy by step: the run's metrics, and its summary's curve (which holds
    the step-0 validation of a run resumed from a shared warm start's checkpoint)."""
    acc = {int(r["step"]): r["val/accuracy"] for r in records if "val/accuracy" in r}
    summary = run_dir / "summary.json"
    if summary.is_file():
        acc.update({int(s): a for s, a in json.loads(summary.read_text()).get("val_curve", [])})
    return acc


def table(run_dirs: List[Path], steps=(0, 50, 100)) -> str:
    """The markdown table of ``run_dirs`` (validation accuracy at ``steps``)."""
    head = ["run"] + [f"acc @ {s}" for s in steps] + ["gen. rounds / step", "train reward (last)"]
    rows = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for run in run_dirs:
        records = _records(run)
        acc = _accuracy(run, records)
        trained = [r for r in records if "train/reward_mean" in r]
        rounds = [r.get("train/dynamic_sampling_tries", 1.0) for r in trained]
        cells = [run.name] + [f"{acc[s]:.3f}" if s in acc else "-" for s in steps]
        cells.append(f"{sum(rounds) / len(rounds):.2f}" if rounds else "-")
        cells.append(f"{trained[-1]['train/reward_mean']:.3f} (step {int(trained[-1]['step'])})"
                     if trained else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args()
    print(table(args.run_dirs))


if __name__ == "__main__":
    main()
