"""Resuming a checkpoint with a changed LR schedule.

- The restored schedule keeps the checkpoint's progress and takes its settings (lr, decay style,
  run length) from the worker's configuration, and so do Adam's betas; the changed settings are
  returned. The lr of the
  next step is checked against the schedule's formula, also for a worker that had stepped
  before loading (progress is set, not added).
- The trainer warns once per worker group, naming the config section and the changed values.
"""

from __future__ import annotations

import json
import logging
import types

import pytest

from dist_utils import run_distributed
from mcore_rl.config.schema import CheckpointConfig, OptimizerConfig
from mcore_rl.controller.trainer import RLTrainer

GBS = 8  # rows of test_value_worker._batch: the global batch of every step here


def _linear_lr(lr: float, optimizer_steps_done: int, total_optimizer_steps: int) -> float:
    """Linear decay from ``lr`` to 0 over the run (no warmup): the lr of the next step."""
    return lr * (1 - optimizer_steps_done / total_optimizer_steps)


def _resume_with_other_schedule(ckpt_dir):
    """A worker takes 3 steps of a linear schedule (lr 1e-2 over 10 steps) and is saved. It is
    restored into (a) a worker of the same configuration and (b) one configured with lr 5e-3
    over 20 steps and Adam beta2 0.99 that had taken a step of its own. Returns what each load reported and the
    lr each used on its next step, and the saved worker's own next lr."""
    from test_value_worker import _batch, _train_step, _worker

    old = OptimizerConfig(lr=1e-2, lr_decay_style="linear", clip_grad=1.0)
    new = OptimizerConfig(lr=5e-3, lr_decay_style="linear", clip_grad=1.0, adam_beta2=0.99)
    saved = _worker(optimizer=old, total_optimizer_steps=10)
    for i in range(3):
        _train_step(saved, _batch(seed=i), lambda b: b)
    saved.save_checkpoint(ckpt_dir)
    same = _worker(optimizer=old, total_optimizer_steps=10)
    changed = _worker(optimizer=new, total_optimizer_steps=20, seed=8)
    _train_step(changed, _batch(seed=5), lambda b: b)
    out = {"same": same.load_checkpoint(ckpt_dir), "changed": changed.load_checkpoint(ckpt_dir)}
    out["changed_betas"] = [tuple(g["betas"]) for g in changed.optimizer.param_groups]
    for name, worker in (("saved", saved), ("same", same), ("changed", changed)):
        out[f"{name}_lr"] = _train_step(worker, _batch(seed=3), lambda b: b)["lr"]
    return out


def test_resume_keeps_progress_and_takes_the_configured_schedule(tmp_path):
    r = run_distributed(_resume_with_other_schedule, 1, str(tmp_path / "ckpt"))[0]
    assert r["same"] == {}
    assert r["saved_lr"] == pytest.approx(_linear_lr(1e-2, 3, 10), rel=1e-12)
    assert r["same_lr"] == r["saved_lr"]
    assert r["changed"] == {"lr": (1e-2, 5e-3), "lr_decay_samples": (10 * GBS, 20 * GBS),
                            "adam_betas": ((0.9, 0.999), (0.9, 0.99))}
    assert set(r["changed_betas"]) == {(0.9, 0.99)}
    # 3 steps done (the step the worker took before loading does not count), new shape
    assert r["changed_lr"] == pytest.approx(_linear_lr(5e-3, 3, 20), rel=1e-12)


class _Group:
    def __init__(self, changed):
        self.changed = changed

    def call(self, method, *args):
        assert method == "load_checkpoint"
        return [self.changed, self.changed]  # two ranks, the same report


def test_resume_warns_naming_the_changed_settings(tmp_path, caplog):
    ckpt = tmp_path / "step_4"
    ckpt.mkdir()
    (ckpt / "controller.json").write_text(json.dumps(
        {"step": 4, "sampler": {}, "sft_done": True, "history": []}))
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.run_dir, trainer.cfg = str(tmp_path), types.SimpleNamespace(checkpoint=CheckpointConfig())
    trainer.sampler = types.SimpleNamespace(load_state_dict=lambda state: None)
    groups = {"policy": _Group({"lr": (1e-3, 5e-4)}), "value": _Group({})}
    trainer._groups = lambda: groups
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):
        trainer.resume(str(ckpt))
    assert trainer.step == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "policy.optimizer's LR schedule differs" in warnings[0]
    assert "from step 4 on" in warnings[0]
    assert "lr 0.001 -> 0.0005" in warnings[0]
