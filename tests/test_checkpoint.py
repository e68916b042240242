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
import os
import shutil
import signal
import subprocess
import sys
import types

import pytest
import torch

from dist_utils import run_distributed
from mcore_rl.config.schema import CheckpointConfig, OptimizerConfig
from mcore_rl.controller.checkpoints import CheckpointManager, DamagedCheckpointError
from mcore_rl.controller.trainer import RLTrainer
from mcore_rl.distributed.worker_group import WorkerError, typed

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
    """A worker group of two ranks that writes what a Megatron save writes: a shard, then
    ``metadata.json`` when the save is complete (with ``async_save``: once
    ``finalize_async_save`` finds the writers done, always when it blocks). Loads are recorded;
    those of ``unreadable`` paths fail as a truncated shard does in torch's unpickler."""

    def __init__(self, changed=None):
        self.changed = changed or {}
        self.loaded, self.writing, self.unreadable = [], [], set()
        self.writers_done = False
        self.die_during_save = False

    @property
    def call(self):
        return typed(self._call)

    def _call(self, method, *args):
        if method == "save_checkpoint":
            path, async_save = args
            os.makedirs(path)
            with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
                f.write(bytes(100))
            if self.die_during_save:
                raise WorkerError("[rank 1]\nKilled")
            if async_save:
                self.writing.append(path)
            else:
                _complete(path)
            return [None, None]
        if method == "finalize_async_save":
            if args[0] or self.writers_done:
                for path in self.writing:
                    _complete(path)
                self.writing = []
            return [not self.writing] * 2
        assert method == "load_checkpoint"
        if args[0] in self.unreadable:
            raise WorkerError("[rank 0]\nTraceback (most recent call last):\n  File ...\n"
                              "EOFError: Ran out of input\n")
        self.loaded.append(args[0])
        return [self.changed] * 2


def _complete(path):
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)


def _state(step):
    return {"step": step, "sampler": {}, "sft_done": True, "history": []}


def _manager(run_dir, groups, **cfg) -> CheckpointManager:
    return CheckpointManager(str(run_dir), CheckpointConfig(**cfg), lambda: groups)


def _listing(run_dir):
    return sorted(os.listdir(run_dir / "checkpoints"))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_resume_warns_naming_the_changed_settings(tmp_path, caplog):
    groups = {"policy": _Group({"lr": (1e-3, 5e-4)}), "value": _Group()}
    _manager(tmp_path, groups).save(4, _state(4))
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.run_dir, trainer.cfg = str(tmp_path), types.SimpleNamespace(checkpoint=CheckpointConfig())
    trainer.sampler = types.SimpleNamespace(load_state_dict=lambda state: None)
    trainer._groups = lambda: groups
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):
        trainer.resume(str(tmp_path / "checkpoints" / "step_4"))
    assert trainer.step == 4
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "policy.optimizer's LR schedule differs" in warnings[0]
    assert "from step 4 on" in warnings[0]
    assert "lr 0.001 -> 0.0005" in warnings[0]


# --------------------------------------------------------------------------- atomic saves


def test_a_save_that_dies_leaves_the_complete_checkpoints_and_latest_skips_it(tmp_path, caplog):
    group = _Group()
    ckpts = _manager(tmp_path, {"policy": group}, keep_last=1)
    ckpts.save(1, _state(1))
    ckpts.save(2, _state(2))
    assert _listing(tmp_path) == ["step_2"]
    manifest = json.loads((tmp_path / "checkpoints" / "step_2" / "manifest.json").read_text())
    assert manifest["files"] == {name: os.path.getsize(tmp_path / "checkpoints" / "step_2" / name)
                                 for name in ("policy/__0_0.distcp", "policy/metadata.json",
                                              "controller.json")}
    group.die_during_save = True  # step 3's shard is written, the save never completes
    with pytest.raises(WorkerError):
        ckpts.save(3, _state(3))
    assert _listing(tmp_path) == ["step_2", "step_3.tmp"]  # keep_last=1 kept step_2

    group.die_during_save = False
    resumed = _manager(tmp_path, {"policy": group}, keep_last=1)  # the next process
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):
        path, state = resumed.load("latest")
    assert path == str(tmp_path / "checkpoints" / "step_2") and state == _state(2)
    assert group.loaded == [os.path.join(path, "policy")]
    assert any("step_3.tmp" in w and "did not finish" in w for w in _warnings(caplog))
    resumed.save(3, _state(3))
    assert _listing(tmp_path) == ["step_3"]
    # a run resumed from an older checkpoint saves a step that exists: replaced, nothing left over
    resumed.save(3, {**_state(3), "history": [1]})
    assert _listing(tmp_path) == ["step_3"]
    assert resumed.load("latest")[1]["history"] == [1]


def _two_checkpoints(run_dir):
    """``(group, manager, step_2 dir)`` after complete saves of steps 1 and 2."""
    group = _Group()
    ckpts = _manager(run_dir, {"policy": group}, keep_last=0)
    for step in (1, 2):
        ckpts.save(step, _state(step))
    return group, ckpts, run_dir / "checkpoints" / "step_2"


def test_truncated_shard_latest_falls_back_and_an_explicit_path_names_the_file(tmp_path, caplog):
    group, ckpts, step_2 = _two_checkpoints(tmp_path)
    shard = step_2 / "policy" / "__0_0.distcp"
    os.truncate(shard, 40)
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):
        path, _ = ckpts.load("latest")
    assert path == str(tmp_path / "checkpoints" / "step_1")
    assert any(f"{shard} has 40 bytes, 100 when saved" in w for w in _warnings(caplog))
    with pytest.raises(DamagedCheckpointError) as error:
        ckpts.load(str(step_2))
    message = str(error.value)
    assert isinstance(error.value, FileNotFoundError)  # the CLI's one-line error, exit 2
    assert "\n" not in message and message.startswith(f"checkpoint.resume={step_2}: ")
    assert f"{shard} has 40 bytes" in message
    assert group.loaded == [os.path.join(path, "policy")]  # the damaged one never reached a worker
    (step_2 / "manifest.json").unlink()
    with pytest.raises(DamagedCheckpointError, match="no manifest.json, its save did not finish"):
        ckpts.load(str(step_2))


def test_a_checkpoint_that_fails_to_load_falls_back_with_the_workers_error(tmp_path, caplog):
    group, ckpts, step_2 = _two_checkpoints(tmp_path)
    group.unreadable = {str(step_2 / "policy")}
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):
        path, state = ckpts.load("latest")
    assert state["step"] == 1
    assert any(f"loading {step_2 / 'policy'} failed: EOFError: Ran out of input" in w
               for w in _warnings(caplog))
    with pytest.raises(DamagedCheckpointError, match="EOFError: Ran out of input"):
        ckpts.load(str(step_2))
    group.unreadable = {str(tmp_path / "checkpoints" / f"step_{s}" / "policy") for s in (1, 2)}
    with pytest.raises(FileNotFoundError, match="no checkpoint under .*; skipped .*; skipped "):
        ckpts.load("latest")
    with pytest.raises(FileNotFoundError, match="step_9: no such directory"):
        ckpts.load(str(tmp_path / "checkpoints" / "step_9"))


def test_pruning_drops_leftovers_and_damaged_checkpoints_never_the_one_just_saved(tmp_path):
    group = _Group()
    ckpts = _manager(tmp_path, {"policy": group}, keep_last=2)
    for step in (1, 2, 5):
        ckpts.save(step, _state(step))
    assert _listing(tmp_path) == ["step_2", "step_5"]
    os.truncate(tmp_path / "checkpoints" / "step_2" / "policy" / "__0_0.distcp", 1)
    (tmp_path / "checkpoints" / "step_7.tmp").mkdir()  # a save killed before it completed
    ckpts.save(3, _state(3))  # a run resumed from an older checkpoint: step_5 is newer
    assert _listing(tmp_path) == ["step_3", "step_5"]
    ckpts.save(4, _state(4))
    assert _listing(tmp_path) == ["step_4", "step_5"]


def test_asynchronous_save_becomes_a_checkpoint_once_written_and_verified(tmp_path):
    group = _Group()
    ckpts = _manager(tmp_path, {"policy": group}, keep_last=1, async_save=True)
    ckpts.save(1, _state(1))
    assert _listing(tmp_path) == ["step_1.tmp"]
    ckpts.poll()  # the writers are still busy
    assert _listing(tmp_path) == ["step_1.tmp"]
    group.writers_done = True
    ckpts.poll()
    assert _listing(tmp_path) == ["step_1"]
    group.writers_done = False
    ckpts.save(2, _state(2))
    assert _listing(tmp_path) == ["step_1", "step_2.tmp"]
    ckpts.save(3, _state(3))  # waits for step 2's writers first
    assert _listing(tmp_path) == ["step_2", "step_3.tmp"]
    assert ckpts.last_step == 3
    ckpts.wait()
    assert _listing(tmp_path) == ["step_3"]
    assert _manager(tmp_path, {"policy": group}).load("latest")[1] == _state(3)


# --------------------------------------------------------------------------- end to end
# The acceptance runs of issue 17 (fp32, CPU, one worker process, no Ray): a run that is
# SIGKILLed in the middle of a save, one with a truncated shard, and one stopped by SIGTERM under
# the Slurm script's stand-ins, each resumed with checkpoint.resume=latest, against a straight
# run whose checkpoints are written asynchronously (checkpoint.async_save).

RUN = ["cluster.use_ray=false", "logging.progress=false", "logging.tensorboard=false",
       "data.synthetic.max_value=4", "data.synthetic.num_train=20", "data.synthetic.num_test=4",
       "sft.steps=10", "sft.batch_size=16", "sft.lr=1e-2", "loss.kl_coef=0.05",
       "grpo.num_prompts_per_step=4", "grpo.num_generations=4", "policy.micro_batch_size=8",
       "grpo.val_at_start=false", "grpo.val_every=0", "grpo.val_num_prompts=4", "grpo.max_steps=3"]

# `mcore-rl ARGS...` in which the controller SIGKILLs itself in the save of RL step STEP, once
# the workers have written their shards and before the manifest: `python -c KILLED STEP ARGS...`.
KILLED_IN_SAVE = """
import os, signal, sys
from mcore_rl.cli import main
from mcore_rl.controller.checkpoints import CheckpointManager

commit = CheckpointManager._commit

def commit_or_die(self):
    if self._pending.step == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    commit(self)

CheckpointManager._commit = commit_or_die
if __name__ == "__main__":
    sys.exit(main(sys.argv[2:]))
"""


def _tensors(ckpt_dir) -> dict:
    """Every tensor of a Megatron torch_dist checkpoint (weights, Adam moments, reference),
    read with torch.distributed.checkpoint in this process (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = f"{ckpt_dir}.pt"
    dcp_to_torch_save(str(ckpt_dir), out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def _assert_same_final_parameters(run_dir, straight):
    final = _tensors(run_dir / "checkpoints" / "step_3" / "policy")
    expected = _tensors(straight / "checkpoints" / "step_3" / "policy")
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert tensor.dtype == torch.float32 and torch.equal(final[name], tensor), name


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A 3-step run with a checkpoint per step, saved asynchronously; its run directory."""
    from mcore_rl.config.loader import load_config
    from mcore_rl.controller.loops import run

    out = tmp_path_factory.mktemp("straight")
    run(load_config("grpo_synthetic", RUN + [f"run.output_dir={out}", "checkpoint.every=1",
                                             "checkpoint.keep_last=0", "checkpoint.async_save=true"]))
    assert _listing(out) == ["step_1", "step_2", "step_3"]
    first, last = (_tensors(out / "checkpoints" / s / "policy") for s in ("step_1", "step_3"))
    # the steps trained: a restore that lost weights or Adam moments would show
    assert not torch.equal(first["embedding.word_embeddings.weight"],
                           last["embedding.word_embeddings.weight"])
    return out


@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(straight, tmp_path, caplog):
    from mcore_rl.config.loader import load_config
    from mcore_rl.controller.loops import run

    out = tmp_path / "run"
    args = RUN + [f"run.output_dir={out}", "checkpoint.every=1", "checkpoint.keep_last=1"]
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_SAVE, "3", "train", *args],
                            capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert _listing(out) == ["step_2", "step_3.tmp"]  # keep_last=1: step_2 stays until step_3 is complete
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):
        run(load_config("grpo_synthetic", args + ["checkpoint.resume=latest"]))
    assert any("step_3.tmp" in w and "did not finish" in w for w in _warnings(caplog))
    assert _listing(out) == ["step_3"]
    _assert_same_final_parameters(out, straight)


@pytest.mark.slow
def test_truncated_shard_latest_falls_back_and_explicit_path_is_a_one_line_error(
        straight, tmp_path, caplog, capsys):
    from mcore_rl.cli import main

    out = tmp_path / "run"
    shutil.copytree(straight, out)
    step_3 = out / "checkpoints" / "step_3"
    shard = step_3 / "policy" / "__0_0.distcp"
    os.truncate(shard, os.path.getsize(shard) // 2)  # what a node dying mid-write leaves
    args = ["eval", *RUN, f"run.output_dir={out}"]
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):
        assert main([*args, "checkpoint.resume=latest"]) == 0
    assert json.loads((out / "eval.json").read_text())["checkpoint"] == str(out / "checkpoints" / "step_2")
    assert any(str(shard) in w for w in _warnings(caplog))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([*args, f"checkpoint.resume={step_3}"])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"mcore-rl eval: error: checkpoint.resume={step_3}: {shard} has ")

# `python FILE train ARGS...`: `mcore-rl` whose run, once RL step 1 is logged, waits up to 30 s
# for the preemption signal (its handler only records it), so the test's SIGTERM lands before
# the run's last step however fast the steps are.
HELD_AFTER_STEP_1 = """
import signal, sys, time
from mcore_rl.cli import main
from mcore_rl.utils.logging import RunLogger

log = RunLogger.log

def log_then_hold(self, step, metrics, advance=True):
    log(self, step, metrics, advance)
    guard = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)  # the run's handler
    deadline = time.monotonic() + 30
    while step == 1 and advance and guard is not None and guard.received is None \\
            and time.monotonic() < deadline:
        time.sleep(0.05)

RunLogger.log = log_then_hold
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigterm_under_slurm_saves_requeues_and_the_requeued_job_ends_as_a_straight_run(
        straight, tmp_path):
    from test_slurm import JOB_ID, Job, requeues

    out = tmp_path / "run"
    args = RUN + [f"run.output_dir={out}", "checkpoint.every=0"]  # only the preemption saves
    held = tmp_path / "held_after_step_1.py"
    held.write_text(HELD_AFTER_STEP_1)
    driver = f"{sys.executable} {held} train"
    (tmp_path / "job").mkdir()
    job = Job(tmp_path / "job", ["n1"], DRIVER_COMMAND=driver)
    proc = job.start(*args)
    try:
        job.wait_for(lambda: any(r["step"] >= 1 for r in _records(out)), "RL step 1", timeout=900)
        proc.send_signal(signal.SIGTERM)  # scancel, a preemption or --signal=B:TERM@...
    finally:
        rc = job.finish(proc, timeout=900)
    assert rc == 75, (job.log_dir / "driver.log").read_text()[-3000:]
    assert len(requeues(job)) == 1 and job.calls[requeues(job)[0]]["args"] == ["requeue", JOB_ID]
    [saved] = _listing(out)
    assert saved in ("step_1", "step_2")  # the step the signal came in finished, then saved

    (tmp_path / "requeued").mkdir()
    requeued = Job(tmp_path / "requeued", ["n1"], DRIVER_COMMAND=driver, SLURM_RESTART_COUNT="1")
    assert requeued.finish(requeued.start(*args), timeout=900) == 0, \
        (requeued.log_dir / "driver.log").read_text()[-3000:]
    assert requeues(requeued) == []
    _assert_same_final_parameters(out, straight)


def _records(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
