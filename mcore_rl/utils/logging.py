"""Run logging: a console progress bar, per-step JSONL metrics, TensorBoard scalars and
optionally a Weights & Biases run, all in one run directory.

Every metric is a float keyed by a slash-separated name (``train/reward``,
``timing/generation_s``); the JSONL line also carries ``step``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

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


# The W&B run id of a run directory, kept so that a resumed run logs to the same W&B run.
WANDB_ID_FILE = "wandb_run_id"


class RunLogger:
    """Writes ``metrics.jsonl`` and TensorBoard events under ``run_dir``; shows a tqdm bar;
    logs to Weights & Biases when asked.

    Args:
        run_dir: the run directory (created).
        total_steps: length of the progress bar.
        start_step: steps already done (resume): the bar starts there.
        progress, tensorboard, jsonl: the ``logging.*`` switches.
        wandb: None, or the arguments of the W&B run: ``project``, ``entity`` (None: the
            account's default), ``name`` and ``config`` (the run's whole config as a dict).
            The run's files go under ``run_dir/wandb``; its id is kept in
            ``run_dir/wandb_run_id``, so a resumed run continues the same W&B run (W&B then
            ignores steps at or below the last one it has).

    Raises:
        ImportError: ``wandb`` is given and the ``wandb`` package is not installed.
    """

    def __init__(self, run_dir: str, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, jsonl: bool = True,
                 wandb: Optional[Dict[str, Any]] = None):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self._wandb = _start_wandb(run_dir, **wandb) if wandb is not None else None
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
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
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
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(run_dir: str, project: str, entity: Optional[str], name: str,
                 config: Dict[str, Any]):
    """A W&B run for ``run_dir`` (:class:`RunLogger`): a new one, or the one whose id
    ``run_dir/wandb_run_id`` keeps."""
    try:
        import wandb
    except ImportError:
        raise ImportError("logging.wandb=true needs the wandb package: pip install wandb") from None
    id_file = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.isfile(id_file):
        with open(id_file) as f:
            kept = dict(id=f.read().strip(), resume="allow")
    else:
        kept = {}
    run = wandb.init(project=project, entity=entity, name=name, dir=run_dir, config=config, **kept)
    if not kept:
        with open(id_file, "w") as f:
            f.write(run.id + "\n")
    return run


def pop_prefixed(records: List[Dict[str, float]], prefix: str
                 ) -> Tuple[Dict[str, float], List[Dict[str, float]]]:
    """``(means, kept)``: the mean of every key over the records that have a key starting with
    ``prefix`` (all their keys), and the other records, in order (what a producer of metrics
    keeps for a later call with another prefix)."""
    out: Dict[str, List[float]] = {}
    kept = []
    for record in records:
        if not any(k.startswith(prefix) for k in record):
            kept.append(record)
            continue
        for k, v in record.items():
            out.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in out.items()}, kept


def read_metrics(run_dir: str) -> list:
    """The JSONL records of a run directory, in order."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
