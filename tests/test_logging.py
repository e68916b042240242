"""Run logging to Weights & Biases (``logging.wandb``).

- With a stand-in ``wandb`` module: the run is started with the project, entity, run name and
  whole config, in the run directory, under an id kept there, so a second logger on the same
  directory (a resumed run) continues the same W&B run; every record is logged at its step;
  the run is finished on close.
- Without the package: the config is refused at load time, and the logger raises naming the
  install command.
- With the real package in offline mode: a run and a resumed run write one W&B run id.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.utils.logging import WANDB_ID_FILE, RunLogger

WANDB = dict(project="proj", entity="team", name="run-a", config={"grpo": {"max_steps": 3}})


class _FakeRun:
    def __init__(self, calls, kwargs, run_id):
        self.calls = calls
        self.id = kwargs.get("id", run_id)
        calls.append(("init", kwargs))

    def log(self, metrics, step):
        self.calls.append(("log", metrics, step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture()
def fake_wandb(monkeypatch):
    calls = []
    ids = iter(["id-1", "id-2"])  # what W&B would name each new run
    module = types.SimpleNamespace(init=lambda **kwargs: _FakeRun(calls, kwargs, next(ids)))
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_run_gets_config_steps_and_keeps_its_id(fake_wandb, tmp_path):
    logger = RunLogger(str(tmp_path), 3, progress=False, tensorboard=False, wandb=WANDB)
    logger.log(0, {"val/accuracy": 0.25}, advance=False)
    logger.log(1, {"train/loss": 2, "train/reward_mean": 0.5})
    logger.close()
    resumed = RunLogger(str(tmp_path), 3, start_step=1, progress=False, tensorboard=False,
                        wandb=WANDB)
    resumed.log(2, {"train/loss": 1.5})
    resumed.close()

    expected_init = dict(project="proj", entity="team", name="run-a",
                         config={"grpo": {"max_steps": 3}}, dir=str(tmp_path))
    assert fake_wandb == [
        ("init", expected_init),  # a new run: W&B names it
        ("log", {"val/accuracy": 0.25}, 0),
        ("log", {"train/loss": 2.0, "train/reward_mean": 0.5}, 1),
        ("finish",),
        ("init", dict(expected_init, id="id-1", resume="allow")),  # the kept run
        ("log", {"train/loss": 1.5}, 2),
        ("finish",),
    ]
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == "id-1"
    # the other sinks are unaffected
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


def test_without_wandb_package_config_and_logger_refuse(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match=r"logging.wandb=true needs the wandb package: pip install wandb"):
        load_config("grpo_synthetic", ["logging.wandb=true"])
    assert load_config("grpo_synthetic", []).logging.wandb is False
    with pytest.raises(ImportError, match="pip install wandb"):
        RunLogger(str(tmp_path), 1, progress=False, tensorboard=False, wandb=WANDB)


def test_real_wandb_offline_run_and_resume_share_one_run(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for start in (0, 2):
        logger = RunLogger(str(tmp_path), 4, start_step=start, progress=False, tensorboard=False,
                           wandb=WANDB)
        for step in (start + 1, start + 2):
            logger.log(step, {"train/loss": 1.0 / step})
        logger.close()
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs  # one directory per process, both holding the one run's log
    assert all((tmp_path / "wandb" / name / f"run-{run_id}.wandb").is_file() for name in runs)
