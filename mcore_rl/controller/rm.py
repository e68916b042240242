"""Reward-model training (``algorithm: rm``): :class:`RewardModelTraining` and its run,
:class:`RewardModelLoop`.

The field's recipe (Stiennon et al. 2020, sec. 3.4; Ouyang et al. 2022, sec. 3.5; TRL's
``RewardTrainer``, OpenRLHF's ``train_rm``, NeMo RL's RM training): a model of the policy's
family whose LM head is replaced by a scalar head (a causal LM's backbone with a fresh head, or
a ``*ForSequenceClassification`` checkpoint), trained on preference pairs with the
Bradley-Terry loss ``-log sigmoid(r_c - r_r - margin)``
(:class:`~mcore_rl.algorithms.preference.BradleyTerryLoss`), each response scored at its last
token. Per step: ``rm.pairs_per_step`` pairs drawn by the resumable sampler of the prompt tasks
(epochs of seeded permutations), one optimizer step of the
:class:`~mcore_rl.workers.reward_model.RewardModelWorker` group (``reward_model.megatron``,
``reward_model.optimizer``; a pair's two rows stay in one micro-batch of
``rm.micro_batch_pairs`` pairs and on one DP rank); validation every ``rm.val_every`` steps:
held-out pair accuracy (``r_c > r_r``), loss and margin on the first ``rm.val_num_pairs`` pairs
of ``rm.test_path``. Checkpoints as the RL loops' (``<run_dir>/checkpoints/step_<k>/
reward_model/`` and ``controller.json``; ``checkpoint.*``); ``mcore-rl export`` writes a
``*ForSequenceClassification`` directory that ``reward.name=model`` scores with
(``reward_model.hf_path``); ``mcore-rl eval`` reports held-out pair accuracy.

Not here (the RL loops have them): the hang watchdog and preemption signals.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from mcore_rl.algorithms.preference import BradleyTerryLoss, bradley_terry_loss, pair_accuracy
from mcore_rl.config.checks import ConfigError
from mcore_rl.config.schema import TrainConfig
from mcore_rl.controller.algorithm import Algorithm
from mcore_rl.controller.checkpoints import CheckpointManager
from mcore_rl.controller.learned_rewards import check_shape, checkpoint_arch
from mcore_rl.controller.trainer import megatron_group, run_logger
from mcore_rl.data.preferences import PreferenceDataset, load_preference_pairs, pair_batch
from mcore_rl.data.prompts import PromptSampler
from mcore_rl.utils.logging import Progress, RunLogger
from mcore_rl.workers.interfaces import RewardModelAPI

GROUP = "reward_model"  # the worker group, and its checkpoint directory


class RewardModelTraining(Algorithm):
    """``algorithm: rm`` in the plugin table: its run is :class:`RewardModelLoop`
    (:meth:`build_loop`), not an RL loop.

    Attributes:
        loss_fn: :class:`~mcore_rl.algorithms.preference.BradleyTerryLoss`.
    """

    name = "rm"
    group_names = (GROUP,)

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.loss_fn = BradleyTerryLoss()

    def policy_schedule(self) -> Tuple[int, int]:
        """``(rm.max_steps, 2 x rm.pairs_per_step)``: one optimizer step per RL-free step, the
        schedule counting rows."""
        return self.cfg.rm.max_steps, 2 * self.cfg.rm.pairs_per_step

    def needs_reference(self) -> bool:
        return False

    def build_loop(self) -> "RewardModelLoop":
        return RewardModelLoop(self.cfg, self)


class RewardModelLoop:
    """The run of ``algorithm: rm`` (module docstring), with the methods of
    :class:`~mcore_rl.controller.trainer.Loop` the entry points call: :meth:`fit`,
    :meth:`evaluate`, :meth:`close`.

    Every input is read and checked before the run directory is written to or a worker starts:
    the tokenizer, the pairs (:func:`~mcore_rl.data.preferences.load_preference_pairs`: a
    malformed line or one without ``chosen`` / ``rejected`` is named) and the model.

    Raises:
        ConfigError: bad pairs, a model not built here or not fitting
            ``reward_model.megatron``.
        FileExistsError: ``run.output_dir`` holds a run and ``checkpoint.resume`` is unset.
    """

    def __init__(self, cfg: TrainConfig, algorithm: RewardModelTraining):
        from mcore_rl.data.tokenizer import load_tokenizer
        from mcore_rl.distributed.placement import Placement, config_plan
        from mcore_rl.megatron.conversion import arch_to_hf_config
        from mcore_rl.megatron.parallel import resolve_device
        from mcore_rl.workers.reward_model import RewardModelWorker

        self.cfg, self.algorithm, rm, d = cfg, algorithm, cfg.rm, cfg.data
        self.run_dir = cfg.run.output_dir
        if not cfg.checkpoint.resume and os.path.exists(os.path.join(self.run_dir, "metrics.jsonl")):
            raise FileExistsError(
                f"run.output_dir={self.run_dir} already holds a run (metrics.jsonl); continue it "
                f"with checkpoint.resume=latest or start a new one with another run.output_dir")
        self.tokenizer = load_tokenizer(cfg.model, d.use_chat_template)

        def pairs(key: str) -> Optional[PreferenceDataset]:
            path = getattr(rm, key)
            if path is None:
                return None
            return PreferenceDataset(load_preference_pairs(path, f"rm.{key}"), self.tokenizer,
                                     d.prompt_template, d.use_chat_template, d.max_prompt_length,
                                     d.max_total_length)

        self.train_data, self.test_data = pairs("train_path"), pairs("test_path")
        if cfg.model.hf_path:
            self.hf_config, self.arch = checkpoint_arch("model.hf_path", cfg.model.hf_path)
            check_shape(self.arch, cfg.reward_model.megatron, GROUP,
                          f"model.hf_path={cfg.model.hf_path}")
        else:
            self.arch = dataclasses.replace(cfg.model.arch,
                                            vocab_size=cfg.model.arch.vocab_size or len(self.tokenizer))
            self.hf_config = arch_to_hf_config(self.arch, self.arch.vocab_size)
        self.hf_config.eos_token_id = self.tokenizer.eos_token_id
        self.hf_config.pad_token_id = self.tokenizer.pad_token_id
        os.makedirs(self.run_dir, exist_ok=True)
        self.tokenizer.save_pretrained(os.path.join(self.run_dir, "tokenizer"))
        self.hf_config.to_json_file(os.path.join(self.run_dir, "hf_config.json"), use_diff=False)

        device = resolve_device(cfg.cluster.device)
        self.placement = Placement(config_plan(cfg.cluster, {GROUP: cfg.cluster.num_workers}, {}),
                                   use_ray=cfg.cluster.use_ray, gpus=device == "cuda",
                                   ray_address=cfg.cluster.ray_address)
        total, rows = algorithm.policy_schedule()
        try:
            self.group = megatron_group(self.placement, cfg, GROUP, RewardModelWorker, dict(
                hf_path=cfg.model.hf_path, hf_config=self.hf_config.to_dict(),
                vocab_size=self.arch.vocab_size, arch=self.arch,
                megatron=cfg.reward_model.megatron, optimizer=cfg.reward_model.optimizer,
                device=device, total_optimizer_steps=total, global_batch_size=rows))
        except BaseException:
            self.placement.shutdown()
            raise
        self.sampler = PromptSampler(len(self.train_data), rm.pairs_per_step, cfg.run.seed)
        self.step = 0
        self.history: List[Dict[str, float]] = []
        self.checkpoints = CheckpointManager(self.run_dir, cfg.checkpoint, lambda: {GROUP: self.group})

    # ------------------------------------------------------------------ steps
    def train_step(self) -> Dict[str, float]:
        """One optimizer step on the sampler's next ``rm.pairs_per_step`` pairs; its metrics as
        ``train/<metric>`` (loss, pair accuracy, margin, scores, grad norm, lr) and
        ``timing/step_s``."""
        start = time.perf_counter()
        batch = pair_batch(self.train_data, self.sampler.next_batch())
        metrics = self.group.train(batch, self.algorithm.loss_fn, 2 * self.cfg.rm.micro_batch_pairs)
        return {**{f"train/{k}": v for k, v in metrics.items()},
                "timing/step_s": time.perf_counter() - start}

    def validate(self) -> Dict[str, float]:
        """Held-out figures on the first ``rm.val_num_pairs`` pairs of ``rm.test_path``:
        ``val/pair_accuracy`` (``r_c > r_r``), ``val/loss`` (the Bradley-Terry loss with the
        pairs' margins, mean), ``val/reward_margin`` (mean ``r_c - r_r``); empty without
        held-out pairs."""
        if self.test_data is None:
            return {}
        n = min(self.cfg.rm.val_num_pairs, len(self.test_data))
        batch = pair_batch(self.test_data, list(range(n)))
        scores = self.group.gather_rows(RewardModelAPI).get_scores(
            batch, 2 * self.cfg.rm.micro_batch_pairs)
        chosen, rejected = scores[0::2], scores[1::2]
        return {"val/pair_accuracy": pair_accuracy(scores),
                "val/loss": float(bradley_terry_loss(chosen, rejected, batch["margin"][0::2]).mean()),
                "val/reward_margin": float((chosen - rejected).mean())}

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> str:
        """Checkpoint of the current step (:class:`CheckpointManager`); the step directory."""
        return self.checkpoints.save(self.step, {"step": self.step, "history": self.history,
                                                 "sampler": self.sampler.state_dict()})

    def resume(self, path: str, warn_schedule: bool = True) -> str:
        """Load a checkpoint directory (or ``"latest"``); the directory loaded."""
        path, state = self.checkpoints.load(path, warn_schedule)
        self.step, self.history = state["step"], state["history"]
        self.sampler.load_state_dict(state["sampler"])
        return path

    # ------------------------------------------------------------------ the run
    def fit(self) -> Dict[str, Any]:
        """Resume if asked, then ``rm.max_steps`` steps with validation, logging (the run
        directory's metrics.jsonl, TensorBoard, ...) and checkpoints; prints and returns the
        summary (held-out pair accuracy at the start and the end)."""
        cfg, rm = self.cfg, self.cfg.rm
        if cfg.checkpoint.resume:
            self.resume(cfg.checkpoint.resume)
        logger = run_logger(cfg, self.run_dir, rm.max_steps, self.step)
        try:
            if self.step == 0 and rm.val_at_start:
                self._validated(0, logger, advance=False)
            while self.step < rm.max_steps:
                metrics = self.train_step()
                self.step += 1
                if rm.val_every > 0 and (self.step % rm.val_every == 0 or self.step == rm.max_steps):
                    metrics.update(self._validated(self.step))
                logger.log(self.step, metrics)
                self.checkpoints.after_step(self.step, self.save)
            self.checkpoints.finish(self.step, self.save)
        finally:
            logger.close()
        summary = self.summary()
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if "val_pair_accuracy_start" in summary:
            print(f"held-out pair accuracy: {summary['val_pair_accuracy_start']:.3f} at step "
                  f"{summary['val_curve'][0][0]} -> {summary['val_pair_accuracy_end']:.3f} at step "
                  f"{summary['steps']}")
        return summary

    def _validated(self, step: int, logger: Optional[RunLogger] = None,
                   advance: bool = True) -> Dict[str, float]:
        val = self.validate()
        if val:
            self.history.append({"step": step, **val})
            if logger is not None:
                logger.log(step, val, advance=advance)
        return val

    def summary(self) -> Dict[str, Any]:
        """Run directory, steps, held-out pair accuracy at the first and last validation and
        the curve."""
        out: Dict[str, Any] = {"run_dir": self.run_dir, "steps": self.step}
        if self.history:
            out["val_pair_accuracy_start"] = self.history[0]["val/pair_accuracy"]
            out["val_pair_accuracy_end"] = self.history[-1]["val/pair_accuracy"]
            out["val_curve"] = [(h["step"], h["val/pair_accuracy"]) for h in self.history]
        return out

    @property
    def eval_stages(self) -> Tuple[str, ...]:
        """The stages of :meth:`evaluate`, as its progress counts them."""
        return ("resume",) * bool(self.cfg.checkpoint.resume) + ("validation",)

    def evaluate(self, progress: Optional[Progress] = None) -> Dict[str, Any]:
        """``mcore-rl eval``: held-out pair accuracy of ``checkpoint.resume`` (or the initial
        weights); writes ``<run_dir>/eval.json``, prints and returns it: :meth:`validate`'s
        figures, ``checkpoint``, ``step``, ``num_pairs``. ``progress`` (stages) is told of each
        of :attr:`eval_stages`.

        Raises:
            ConfigError: no held-out pairs (``rm.test_path``).
        """
        if self.test_data is None:
            raise ConfigError("mcore-rl eval of a reward model needs held-out pairs: rm.test_path")
        progress = progress or Progress("eval", 0, enabled=False)
        resume = self.cfg.checkpoint.resume
        checkpoint = None
        if resume:
            progress.phase("resume")
            checkpoint = self.resume(resume, warn_schedule=False)
            progress.advance({"step": str(self.step)})
        progress.phase("validation")
        val = self.validate()
        progress.advance({"pair_acc": f"{val['val/pair_accuracy']:.3f}"}
                         if "val/pair_accuracy" in val else {})
        out = {"checkpoint": checkpoint, "step": self.step,
               "num_pairs": min(self.cfg.rm.val_num_pairs, len(self.test_data)), **val}
        path = os.path.join(self.run_dir, "eval.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"held-out pair accuracy: {out['val/pair_accuracy']:.3f} on {out['num_pairs']} pairs "
              f"(rm.val_num_pairs), {checkpoint or 'initial weights'} (step {self.step}); written "
              f"to {path}")
        return out

    def close(self) -> None:
        """Shut the worker group down and release its placement."""
        self.group.shutdown()
        self.placement.shutdown()
