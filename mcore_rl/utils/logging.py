"""Run logging: console progress, per-step JSONL metrics, TensorBoard scalars and optionally a
Weights & Biases run, all in one run directory.

Every metric is a float keyed by a slash-separated name (``train/reward``,
``timing/generation_s``); the JSONL line also carries ``step``.

Console progress (:class:`Progress`, ``logging.progress``): on a terminal a tqdm bar with the
step, the phase running, the latest figures and the time left::

    grpo:  45%|████▌     | 45/100 [01:02<01:15,  1.38s/step, phase=generation, reward=0.512, val_acc=0.640, loss=0.0312]

elsewhere (output to a file or a pipe, as under Slurm) no bar: one summary line per step,
with that step's figures, the mean seconds per step so far and the time left::

    grpo step 45/100: reward 0.512, loss 0.0312, kl 0.00121, clip 0, gnorm 1.23, 1.38 s/step, 01:15 left
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from tqdm import tqdm

# Figures shown on the RL progress bar and lines when present: label -> (metric name, format).
_BAR_FIGURES = {
    "reward": ("train/reward_mean", ".3f"),
    "val_acc": ("val/accuracy", ".3f"),
    "pair_acc": ("val/pair_accuracy", ".3f"),  # a reward model's (algorithm=rm)
    "loss": ("train/loss", ".4g"),
    "kl": ("train/kl", ".3g"),
    "clip": ("train/clip_fraction", ".3g"),
    "gnorm": ("train/grad_norm", ".3g"),
}


def _is_terminal(stream: Optional[TextIO]) -> bool:
    """Whether ``stream`` is an interactive terminal (a closed or odd stream is not)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """Console progress of one run of steps: the warm start's SFT steps, the RL steps, an eval's
    or a GGUF conversion's stages.

    Three modes, fixed at construction (:attr:`mode`):

    - ``"bar"`` (``enabled`` and ``stream`` is a terminal): a tqdm bar on ``stream``: steps done
      of ``total``, elapsed and estimated time left, seconds per ``unit``, then the phase
      running (:meth:`phase`) and the latest figure of each name (:meth:`advance`). The bar
      appears at the first :meth:`phase` or :meth:`advance` (so that two runs of steps, such
      as the warm start and the RL steps, do not show at once); its clock starts there.
    - ``"lines"`` (``enabled``, ``stream`` not a terminal: a log file, a pipe): no bar; every
      ``every`` steps and at the last, one line on stdout: ``<desc> <unit> <n>/<total>:
      <figures of that step>, <mean seconds per unit> s/<unit>, <time left> left`` (stage
      progress names the stage done: ``eval stage 2/3 (refit): ...``).
    - ``"off"``: nothing.

    Args:
        desc: what runs (``grpo``, ``sft``, ``eval``, ``convert-gguf``).
        total: steps (or stages) in all.
        initial: steps already done (a resumed run).
        enabled: ``logging.progress``.
        every: lines mode: print every ``every``-th step (and the last).
        unit: ``"step"``, or ``"stage"`` for a sequence of named phases (lines then name the
            stage done).
        stream: where the bar goes and whose terminal-ness picks the mode (default stderr).
        order: figure labels in the order the bar shows them (others follow as they come).
    """

    def __init__(self, desc: str, total: int, initial: int = 0, enabled: bool = True,
                 every: int = 1, unit: str = "step", stream: Optional[TextIO] = None,
                 order: Sequence[str] = ()):
        self.desc, self.total, self.unit = desc, total, unit
        self.n = self._initial = initial
        self.every = max(1, every)
        self._stream = sys.stderr if stream is None else stream
        self.mode = "off" if not enabled else ("bar" if _is_terminal(self._stream) else "lines")
        self._bar: Optional[tqdm] = None
        self._started: Optional[float] = None
        self._phase: Optional[str] = None
        self._order = list(order)
        self._shown: Dict[str, str] = {}  # the latest figures: the bar's postfix

    def _start(self) -> None:
        if self._started is not None:
            return
        self._started = time.monotonic()
        if self.mode == "bar":
            self._bar = tqdm(total=self.total, initial=self._initial, desc=self.desc,
                             unit=self.unit, dynamic_ncols=True, file=self._stream)

    def _refresh(self, redraw: bool) -> None:
        if self._bar is None:
            return
        labels = [k for k in self._order if k in self._shown]
        labels += [k for k in self._shown if k not in self._order]
        postfix = ({"phase": self._phase} if self._phase else {}) | {
            k: self._shown[k] for k in labels}
        self._bar.set_postfix(postfix, refresh=redraw)

    def set_total(self, total: int) -> None:
        """The steps (stages) in all are ``total`` after all (known once the work is built)."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def phase(self, name: Optional[str]) -> None:
        """Show ``name`` as the phase running (None: none)."""
        if self.mode == "off" or name == self._phase:
            return
        self._start()
        self._phase = name
        self._refresh(redraw=True)

    def advance(self, figures: Optional[Mapping[str, str]] = None, steps: int = 1) -> None:
        """Record ``figures`` (label -> formatted value) of the step just done and move on by
        ``steps`` (0: a record without a step, as the validation before the first RL step; a
        line then names the current step without timing)."""
        if self.mode == "off":
            return
        self._start()
        figures = dict(figures or {})
        self._shown.update(figures)
        done_phase = self._phase
        self.n += steps
        if self._bar is not None:
            self._refresh(redraw=steps == 0)
            if steps:
                self._bar.update(steps)
        elif steps == 0 or self.n % self.every == 0 or self.n >= self.total:
            print(self.line(figures, timing=steps > 0, stage=done_phase), flush=True)

    def line(self, figures: Mapping[str, str], timing: bool = True,
             stage: Optional[str] = None) -> str:
        """The summary line of the current step (lines mode): ``figures``, then with ``timing``
        the mean seconds per unit so far and the time left."""
        head = f"{self.desc} {self.unit} {self.n}/{self.total}"
        if self.unit != "step" and stage:
            head += f" ({stage})"
        parts = [f"{k} {v}" for k, v in figures.items()]
        done = self.n - self._initial
        if timing and done > 0 and self._started is not None:
            per = (time.monotonic() - self._started) / done
            left = tqdm.format_interval(max(0, self.total - self.n) * per)
            parts += [f"{per:.3g} s/{self.unit}", f"{left} left"]
        return head + (": " + ", ".join(parts) if parts else "")

    def write(self, message: str) -> None:
        """Print a line on stdout without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Close the bar (it stays on screen as it last was); nothing shows after."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.mode = "off"


# The W&B run id of a run directory, kept so that a resumed run logs to the same W&B run.
WANDB_ID_FILE = "wandb_run_id"


class RunLogger:
    """Writes ``metrics.jsonl`` and TensorBoard events under ``run_dir``; shows the RL steps'
    console progress (:class:`Progress`: a bar on a terminal, a line per step elsewhere); logs
    to Weights & Biases when asked.

    Args:
        run_dir: the run directory (created).
        total_steps: the RL steps in all.
        start_step: steps already done (resume): the progress starts there.
        progress, tensorboard, jsonl: the ``logging.*`` switches.
        wandb: None, or the arguments of the W&B run: ``project``, ``entity`` (None: the
            account's default), ``name`` and ``config`` (the run's whole config as a dict).
            The run's files go under ``run_dir/wandb``; its id is kept in
            ``run_dir/wandb_run_id``, so a resumed run continues the same W&B run (W&B then
            ignores steps at or below the last one it has).
        desc: the progress's name (the algorithm).

    Raises:
        ImportError: ``wandb`` is given and the ``wandb`` package is not installed.
    """

    def __init__(self, run_dir: str, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, jsonl: bool = True,
                 wandb: Optional[Dict[str, Any]] = None, desc: str = "grpo"):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self._wandb = _start_wandb(run_dir, **wandb) if wandb is not None else None
        self.show_progress = progress
        self.progress = Progress(desc, total_steps, start_step, enabled=progress,
                                 order=list(_BAR_FIGURES))

    def stage(self, desc: str, total: int, every: int = 1) -> Progress:
        """A :class:`Progress` of its own for steps before the RL steps (the warm start's),
        in the mode of the RL steps'; close it before the RL steps begin."""
        return Progress(desc, total, enabled=self.show_progress, every=every)

    def phase(self, name: Optional[str]) -> None:
        """Show ``name`` as the RL step's phase running (None: none)."""
        self.progress.phase(name)

    def log(self, step: int, metrics: Dict[str, float], advance: bool = True) -> None:
        """Record ``metrics`` for ``step``; ``advance`` moves the progress on by one step (a
        line then shows the step's figures; the bar keeps the latest of each)."""
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
        figures = {label: format(clean[name], spec)
                   for label, (name, spec) in _BAR_FIGURES.items() if name in clean}
        self.progress.advance(figures, steps=1 if advance else 0)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        self.progress.write(message)

    def close(self) -> None:
        self.progress.close()
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
