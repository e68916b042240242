"""``mcore-rl plot``: a run's curves from its ``metrics.jsonl``, as a PNG and an SVG.

One panel per metric group (:data:`PANELS`), each with one curve per run (several runs
overlaid, named by their run directory's name, ``runs/<run.name>``):

- ``reward``: the rollouts' mean reward per RL step (``train/reward_mean``);
- ``accuracy``: held-out accuracy at each validation (``val/accuracy``);
- ``timing``: seconds per RL step by phase (``timing/<phase>_s``: the step, generation,
  logprobs, train, refit, ...; colour is the phase, line style the run);
- ``mismatch``: the trainer-vs-rollout logprob mismatch, mean and max over response tokens
  (``train/logprob_mismatch_mean``, ``_max``: ``docs/logprob-contract.md``);
- ``length``: mean response length in tokens, of the rollouts and of the held-out answers
  (``train/response_length``, ``val/response_length``).

Any other logged metric is a panel of its own by its name (``train/kl``). Without a choice
the panels the runs have data for are drawn; a panel chosen by name must have data.

The figure's size is fixed by its panel count (:data:`PANEL_INCHES` at :data:`DPI`, up to
:data:`COLUMNS` panels a row), not by the data; the PNG carries the metric names plotted and
the run names as text chunks (``Metrics``, ``Runs``).

Input mistakes (no such directory, no ``metrics.jsonl``, a line that is not JSON, an unknown
or absent metric) raise ``FileNotFoundError`` or ``ValueError`` naming what and where: the
command prints them as one line and exits with status 2.

This module imports nothing of the package (the ``utils`` floor); matplotlib is imported when
a figure is drawn.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

METRICS_FILE = "metrics.jsonl"
FORMATS = ("png", "svg")
DPI = 100
PANEL_INCHES = (4.8, 3.4)  # width, height of one panel
COLUMNS = 3
TIMING_PREFIX, TIMING_SUFFIX = "timing/", "_s"


@dataclass(frozen=True)
class Panel:
    """A panel: its title, y-axis label, and the metrics it draws (metric -> legend label;
    a prefix ending in ``/`` with :attr:`family` takes every metric under it)."""

    title: str
    ylabel: str
    metrics: Tuple[Tuple[str, str], ...]
    family: bool = False


PANELS: Dict[str, Panel] = {
    "reward": Panel("reward (rollout mean)", "reward", (("train/reward_mean", "train"),)),
    "accuracy": Panel("held-out accuracy", "accuracy", (("val/accuracy", "held-out"),)),
    "timing": Panel("seconds per RL step by phase", "seconds",
                    ((TIMING_PREFIX, ""),), family=True),
    "mismatch": Panel("logprob mismatch |trainer - rollout|", "nats per token",
                      (("train/logprob_mismatch_mean", "mean"),
                       ("train/logprob_mismatch_max", "max"))),
    "length": Panel("response length", "tokens",
                    (("train/response_length", "train"), ("val/response_length", "held-out"))),
}
DEFAULT_PANELS = tuple(PANELS)

# A series: steps and values of one metric of one run.
Series = Tuple[List[int], List[float]]


def read_run(run_dir: str) -> Dict[str, Series]:
    """The metrics of ``run_dir/metrics.jsonl`` as ``{metric: (steps, values)}`` in step order;
    a step logged twice (a resumed run that redid it) keeps its last value. A last line cut
    short (a run still writing) is skipped.

    Raises:
        FileNotFoundError: ``run_dir`` is no directory, or has no ``metrics.jsonl``.
        ValueError: a line is not a JSON object with a ``step``, or the file has no records.
    """
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir}: no {METRICS_FILE} (not a run directory, or a run "
                                f"with logging.jsonl=false)")
    with open(path) as f:
        lines = f.read().split("\n")
    by_metric: Dict[str, Dict[int, float]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record.pop("step"))
            values = {k: float(v) for k, v in record.items()}
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            if number == len(lines):  # no newline after it: still being written
                continue
            raise ValueError(f"{path} line {number}: not a metrics record ({type(e).__name__}: "
                             f"{e})") from None
        for k, v in values.items():
            by_metric.setdefault(k, {})[step] = v
    if not by_metric:
        raise ValueError(f"{path}: no metrics recorded yet")
    return {k: (sorted(s), [s[i] for i in sorted(s)]) for k, s in by_metric.items()}


def run_names(run_dirs: Sequence[str]) -> List[str]:
    """Each run's name: its directory's name (``runs/<run.name>``), or the path as given where
    two runs share a name."""
    names = [os.path.basename(os.path.normpath(os.path.abspath(d))) for d in run_dirs]
    return [n if names.count(n) == 1 else os.path.normpath(d) for n, d in zip(names, run_dirs)]


def parse_choice(choice: Optional[str]) -> Tuple[List[str], bool]:
    """``--metrics`` (comma-separated panel names of :data:`PANELS` and metric names as logged,
    ``train/kl``) as a list, and whether it was chosen (None: the default panels).

    Raises:
        ValueError: an empty choice, or a name that is neither a panel nor a metric name.
    """
    if choice is None:
        return list(DEFAULT_PANELS), False
    names = [n.strip() for n in choice.split(",") if n.strip()]
    if not names:
        raise ValueError("--metrics: empty; expected panels " + ", ".join(PANELS)
                         + " or metric names as logged (train/kl)")
    for name in names:
        if name not in PANELS and "/" not in name:
            raise ValueError(f"--metrics {name}: not a panel ({', '.join(PANELS)}) nor a metric "
                             f"name as logged in {METRICS_FILE} (train/kl)")
    return names, True


def _panel(name: str) -> Panel:
    return PANELS.get(name) or Panel(name, name.rsplit("/", 1)[-1], ((name, ""),))


def _curves(panel: Panel, run: Mapping[str, Series]) -> List[Tuple[str, str, Series]]:
    """The (metric, legend label, series) a run has for ``panel``."""
    if panel.family:
        prefix = panel.metrics[0][0]
        keys = sorted((k for k in run if k.startswith(prefix) and k.endswith(TIMING_SUFFIX)),
                      key=lambda k: (k != f"{prefix}step{TIMING_SUFFIX}", k))
        return [(k, k[len(prefix):-len(TIMING_SUFFIX)], run[k]) for k in keys]
    return [(k, label, run[k]) for k, label in panel.metrics if k in run]


def smooth(values: Sequence[float], weight: float) -> List[float]:
    """TensorBoard's smoothing: an exponential moving average with ``weight`` on the past,
    debiased at the start (``weight`` 0: the values as they are)."""
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last, norm = weight * last + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(last / norm if norm else v)
    return out


def plot_runs(run_dirs: Sequence[str], output: Optional[str] = None,
              metrics: Optional[str] = None, formats: Sequence[str] = FORMATS,
              smoothing: float = 0.0) -> Dict[str, object]:
    """Draw the curves of ``run_dirs`` (overlaid) and write them.

    Args:
        run_dirs: run directories, each with a ``metrics.jsonl``.
        output: the file to write without or with its suffix (``.png`` / ``.svg``); default
            ``<first run dir>/curves``. Each of ``formats`` is written with its suffix.
        metrics: ``--metrics`` (:func:`parse_choice`); None: :data:`DEFAULT_PANELS` that have
            data.
        formats: among :data:`FORMATS`.
        smoothing: :func:`smooth`'s weight for per-step curves (accuracy is drawn as is);
            the raw curve stays, faint, behind the smoothed one.

    Returns:
        ``{"files": [paths written], "panels": {panel: [metrics drawn]}, "runs": [names]}``.

    Raises:
        FileNotFoundError: a run directory or its ``metrics.jsonl`` is missing.
        ValueError: a bad ``metrics.jsonl`` line, an unknown or absent metric choice, a bad
            output suffix, format or smoothing.
    """
    if not run_dirs:
        raise ValueError("no run directory given")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"--smooth {smoothing:g}: expected a weight in [0, 1)")
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    stem = output or os.path.join(run_dirs[0], "curves")
    suffix = os.path.splitext(stem)[1]
    if suffix:
        if suffix[1:].lower() not in FORMATS:
            raise ValueError(f"--output {stem}: expected a .png or .svg file, or no suffix")
        stem = stem[: -len(suffix)]
    names, chosen = parse_choice(metrics)
    runs = [read_run(d) for d in run_dirs]
    labels = run_names(run_dirs)

    drawn: Dict[str, List[Tuple[str, List[Tuple[str, str, Series]]]]] = {}
    for name in names:
        per_run = [(label, _curves(_panel(name), run)) for label, run in zip(labels, runs)]
        if any(curves for _, curves in per_run):
            drawn[name] = per_run
        elif chosen:
            raise ValueError(f"--metrics {name}: no such metric in "
                             + ", ".join(os.path.join(d, METRICS_FILE) for d in run_dirs))
    if not drawn:
        raise ValueError("nothing to plot: none of " + ", ".join(names) + " in "
                         + ", ".join(os.path.join(d, METRICS_FILE) for d in run_dirs))

    figure = _draw(drawn, smoothing, ", ".join(labels))
    panels = {name: sorted({k for _, curves in per_run for k, _, _ in curves})
              for name, per_run in drawn.items()}
    plotted = ", ".join(k for keys in panels.values() for k in keys)
    directory = os.path.dirname(stem)
    if directory:
        os.makedirs(directory, exist_ok=True)
    files = []
    for fmt in formats:
        path = f"{stem}.{fmt}"
        metadata = {"Title": "mcore-rl plot: " + ", ".join(labels),
                    "Description": f"metrics: {plotted}"}
        if fmt == "png":  # PNG text chunks take any key
            metadata.update(Metrics=plotted, Runs=", ".join(labels))
        else:  # no date: the same runs give the same file
            metadata.update(Date=None)
        figure.savefig(path, format=fmt, dpi=DPI, metadata=metadata)
        files.append(path)
    return {"files": files, "panels": panels, "runs": labels}


def _draw(drawn, smoothing: float, title: str):
    """The figure of :func:`plot_runs`'s panels, titled ``title`` (matplotlib's object API: no
    pyplot state, no display)."""
    from matplotlib.figure import Figure

    count = len(drawn)
    columns = min(COLUMNS, count)
    rows = math.ceil(count / columns)
    figure = Figure(figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows), dpi=DPI,
                    layout="constrained")
    figure.suptitle(title)
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    colors = [f"C{i}" for i in range(10)]
    styles = ["-", "--", ":", "-."]
    several = len(next(iter(drawn.values()))) > 1
    for ax, (name, per_run) in zip(axes, drawn.items()):
        panel = _panel(name)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        metric_styles = {k: styles[i % len(styles)] for i, (k, _) in enumerate(panel.metrics)}
        phase_colors: Dict[str, str] = {}
        for r, (run, curves) in enumerate(per_run):
            for key, label, (steps, values) in curves:
                if panel.family:  # colour: the phase; style: the run
                    color = phase_colors.setdefault(label, "black" if label == "step" else
                                                    colors[len(phase_colors) % len(colors)])
                    style = styles[r % len(styles)]
                    legend = f"{label} ({run})" if several else label
                else:  # colour: the run; style: the metric
                    color, style = colors[r % len(colors)], metric_styles[key]
                    legend = ", ".join(x for x in (run if several else "", label) if x) or run
                # a metric of some steps only (validation's): markers on its points
                sparse = len(steps) < 2 or steps[-1] - steps[0] + 1 > 2 * len(steps)
                marker = "o" if sparse else None
                if smoothing and not sparse:
                    ax.plot(steps, values, color=color, linestyle=style, alpha=0.25, lw=1)
                    values = smooth(values, smoothing)
                ax.plot(steps, values, color=color, linestyle=style, marker=marker, ms=3,
                        lw=2 if label == "step" else 1.4, label=legend)
        ax.legend(fontsize=7, loc="best")
    for ax in axes[count:]:
        ax.set_visible(False)
    return figure
