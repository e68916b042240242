"""Checkpoints of a run: where they live, saving every worker group with the controller's
state, resuming, pruning.

Layout: ``<run_dir>/checkpoints/step_<N>/`` holds one Megatron dist checkpoint per worker group
(``policy/``, ``value/``: written by
:meth:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker.save_checkpoint`) and
``controller.json`` (the RL step, the prompt sampler's state, ...).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Callable, Dict, Tuple

from mcore_rl.config.schema import CheckpointConfig

_log = logging.getLogger(__name__)

CONTROLLER_STATE = "controller.json"


class CheckpointManager:
    """Saves and loads the checkpoints of one run directory.

    Args:
        run_dir: the run directory (``run.output_dir``).
        cfg: the ``checkpoint`` config section (``keep_last``).
        groups: returns the worker groups by sub-directory name (``{"policy": group}``); each
            answers ``call("save_checkpoint", path)`` and ``call("load_checkpoint", path)``
            on all its ranks.
    """

    def __init__(self, run_dir: str, cfg: CheckpointConfig, groups: Callable[[], Dict[str, Any]]):
        self.root = os.path.join(run_dir, "checkpoints")
        self.cfg = cfg
        self.groups = groups

    def step_dir(self, step: int) -> str:
        """The checkpoint directory of RL step ``step``."""
        return os.path.join(self.root, f"step_{step}")

    def save(self, step: int, state: Dict[str, Any]) -> str:
        """Save every worker group (``<step dir>/<group name>``) and the controller's ``state``
        (JSON-serialisable); prune to ``keep_last``. Returns the step directory."""
        path = self.step_dir(step)
        for name, group in self.groups().items():
            group.call("save_checkpoint", os.path.join(path, name))
        with open(os.path.join(path, CONTROLLER_STATE), "w") as f:
            json.dump(state, f)
        self._prune()
        return path

    def _prune(self) -> None:
        keep = self.cfg.keep_last
        steps = sorted(int(d.split("_")[1]) for d in os.listdir(self.root) if d.startswith("step_"))
        for s in steps[:-keep] if keep > 0 else []:
            shutil.rmtree(self.step_dir(s), ignore_errors=True)

    def load(self, path: str, warn_schedule: bool = True) -> Tuple[str, Dict[str, Any]]:
        """Load a checkpoint directory (or ``"latest"``) into every worker group. Each group's
        LR schedule keeps the checkpoint's progress and takes its settings from the
        configuration; with ``warn_schedule`` a warning names the settings that changed.

        Returns:
            the directory loaded and the controller state saved with it.

        Raises:
            FileNotFoundError: naming ``checkpoint.resume`` when there is no checkpoint.
        """
        if path == "latest":
            steps = sorted(int(d.split("_")[1]) for d in os.listdir(self.root) if d.startswith("step_")) \
                if os.path.isdir(self.root) else []
            if not steps:
                raise FileNotFoundError(f"checkpoint.resume=latest: no checkpoint under {self.root}")
            path = self.step_dir(steps[-1])
        state_file = os.path.join(path, CONTROLLER_STATE)
        if not os.path.isfile(state_file):
            raise FileNotFoundError(f"checkpoint.resume={path}: no {CONTROLLER_STATE} there")
        with open(state_file) as f:
            state = json.load(f)
        for name, group in self.groups().items():
            changed = group.call("load_checkpoint", os.path.join(path, name))[0]
            if changed and warn_schedule:
                _log.warning(
                    "checkpoint.resume: %s.optimizer's LR schedule differs from %s; the "
                    "configured one applies from step %d on (checkpoint -> config): %s", name,
                    path, state["step"], ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
        return path, state
