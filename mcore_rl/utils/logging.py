"""Run logging: a console progress bar, per-step JSONL metrics and TensorBoard scalars, all
in one run directory.

Every metric is a float keyed by a slash-separated name (``train/reward``,
``timing/generation_s``); the JSONL line also carries ``step``.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

from tqdm import tqdm

# Figures shown on the progress bar when present (short label -> metric name).
_BAR_FIGURES = {
    "reward": "train/reward_mean",
    "val_acc": "val/accuracy",
    "loss": "train/loss",
    "kl": "train/kl",
    "clip": "train/clip_fraction",
    "gnorm": "train/grad_norm",
    "s/step": "timing/step_s",
}


class RunLogger:
    """Writes ``metrics.jsonl`` and TensorBoard events under ``run_dir``; shows a tqdm bar.

    Args:
        run_dir: the run directory (created).
        total_steps: length of the progress bar.
        start_step: steps already done (resume): the bar starts there.
        progress, tensorboard, jsonl: the ``logging.*`` switches.
    """

    def __init__(self, run_dir: str, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, jsonl: bool = True):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self._bar = tqdm(total=total_steps, initial=start_step, desc="grpo", dynamic_ncols=True,
                         disable=not progress)
        self._shown: Dict[str, float] = {}

    def log(self, step: int, metrics: Dict[str, float], advance: bool = True) -> None:
        """Record ``metrics`` for ``step``; ``advance`` moves the progress bar by one."""
        clean = {k: float(v) for k, v in metrics.items()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        for label, name in _BAR_FIGURES.items():
            if name in clean:
                self._shown[label] = clean[name]
        self._bar.set_postfix({k: f"{v:.3g}" for k, v in self._shown.items()}, refresh=False)
        if advance:
            self._bar.update(1)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str) -> list:
    """The JSONL records of a run directory, in order."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
