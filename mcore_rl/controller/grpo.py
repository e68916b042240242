"""The single controller of a GRPO run.

Per RL step: sample prompts -> generate ``num_generations`` responses each (rollout backend)
-> score with the verifier in the reward pool (:mod:`mcore_rl.rewards.pool`) while the policy
computes the old (and reference) logprobs, then collect the rewards (plus DAPO's overlong
penalty; with DAPO's dynamic sampling, scored before the logprobs, round by round until the
batch holds ``num_prompts_per_step`` groups of unequal rewards) -> advantages (``grpo.advantage_estimator``) -> DAPO's
overlong filtering -> ``optimizer_steps_per_rollout`` updates with the policy loss
(``loss.name``) -> refit the rollout backend with the new weights -> log. Validation (greedy
accuracy on held-out prompts) every ``grpo.val_every`` steps; checkpoints every
``checkpoint.every`` steps. An optional supervised warm start on the
task's reference answers runs first (``sft.steps``). The shared machinery is
:class:`~mcore_rl.controller.trainer.RLTrainer`.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from mcore_rl.algorithms import dapo
from mcore_rl.algorithms.registry import advantage_estimator, build_policy_loss
from mcore_rl.config.schema import TrainConfig
from mcore_rl.controller.logprob_budget import MISMATCH_KEYS
from mcore_rl.controller.streaming import StreamingLoop
from mcore_rl.controller.trainer import RLTrainer, run_eval, run_trainer
from mcore_rl.data import batch as B


class GRPOTrainer(RLTrainer):
    """GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1) on
    :class:`~mcore_rl.controller.trainer.RLTrainer`: config section ``grpo``."""

    algorithm = "grpo"
    _reward_errors = 0  # reward errors of the RL step so far (every generation round)

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.loss_fn = build_policy_loss(cfg)
        self.estimator = advantage_estimator(cfg.grpo.advantage_estimator)

    def _needs_reference(self) -> bool:
        return super()._needs_reference() or self.cfg.grpo.reward_kl_coef > 0

    def _scored_groups(self) -> B.Batch:
        """One round of the step's prompts, generated and scored, with DAPO's overlong penalty
        added to the rewards (``grpo.overlong_buffer_length``); counts reward errors."""
        g = self.cfg.grpo
        rollout, errors = self.generate_and_score(g.num_generations)
        self._reward_errors += errors
        self._shape_rewards(rollout)
        return rollout

    def _shape_rewards(self, rollout: B.Batch) -> None:
        """DAPO's overlong penalty (``grpo.overlong_buffer_length``) added to ``rewards`` [B]
        in place; nothing without a buffer."""
        g = self.cfg.grpo
        if g.overlong_buffer_length:
            rollout["rewards"] = rollout["rewards"] + dapo.overlong_penalty(
                rollout["response_lengths"], self.cfg.generation.max_new_tokens,
                g.overlong_buffer_length, g.overlong_penalty_factor)

    def _set_advantages(self, rollout: B.Batch) -> None:
        """``advantages`` [B, S] of ``grpo.advantage_estimator``, then DAPO's overlong filtering
        (``grpo.overlong_filtering``: truncated rows leave the loss through ``sample_mask``)."""
        rollout["advantages"] = self.estimator(rollout, self.cfg)
        if self.cfg.grpo.overlong_filtering:
            rollout["sample_mask"] = rollout["sample_mask"] * (1 - rollout["truncated"])

    def _policy_schedule(self) -> Tuple[int, int]:
        g = self.cfg.grpo
        rollout_size = g.num_prompts_per_step * g.num_generations
        return g.max_steps * g.optimizer_steps_per_rollout, rollout_size // g.optimizer_steps_per_rollout

    def rl_step(self) -> Dict[str, float]:
        """One RL step; returns its metrics."""
        g = self.cfg.grpo
        t = self.timer
        with t.phase("step"):
            self._reward_errors, sampling = 0, {}
            pending = None
            if g.dynamic_sampling:  # keeps or drops groups by their rewards: scored at once
                rollout, sampling = dapo.dynamic_sampling(
                    self._scored_groups, g.num_prompts_per_step, g.num_generations,
                    g.dynamic_sampling_max_tries)
            else:  # scored in the reward pool while the policy computes the logprobs
                rollout, pending = self.generate_and_submit(g.num_generations)
            # loss.prev_logprobs=train_forward: the training forward's logprobs are the old ones
            recompute = self.cfg.loss.prev_logprobs == "recompute"
            with t.phase("logprobs"):
                if recompute:
                    rollout["prev_logprobs"] = self._logprobs(rollout)
                if self.use_reference:
                    rollout["reference_logprobs"] = self._logprobs(rollout, "get_reference_logprobs")
            if pending is not None:
                self._reward_errors = self.collect_rewards(rollout, pending)
                self._shape_rewards(rollout)
            if recompute:
                self.check_logprob_budget(rollout)  # before the optimizer step: may stop the run
            self._set_advantages(rollout)
            with t.phase("train"):
                train_metrics = [self._train(part, self.loss_fn)
                                 for part in B.shard(rollout, g.optimizer_steps_per_rollout)]
            if not recompute:  # measured by the training forward (one shard: load-time check)
                self.logprob_budget.observe(
                    self.step + 1, {f"train/{k}": train_metrics[0][k] for k in MISMATCH_KEYS},
                    trained=True)
            with t.phase("refit"):
                refit = self.refit()
        metrics = self.rollout_metrics(rollout, self._reward_errors,
                                       t.seconds("generation"))
        metrics.update({f"train/{k}": v for k, v in sampling.items()})
        for k in train_metrics[-1]:
            metrics[f"train/{k}"] = sum(m[k] for m in train_metrics) / len(train_metrics)
        metrics.update(refit)
        metrics.update(self.timer.pop())
        metrics.update(self.reward_timing())
        return metrics


class StreamingGRPOTrainer(StreamingLoop, GRPOTrainer):
    """GRPO (:class:`GRPOTrainer`) with the streaming loop (``grpo.streaming``): each group's
    rewards shaped and advantages set as it is scored (a per-group estimator: load-time
    check)."""

    def _score_group(self, rows: B.Batch) -> None:
        self._shape_rewards(rows)
        self._set_advantages(rows)


def trainer_class(cfg: TrainConfig):
    """:class:`GRPOTrainer`, or with ``grpo.streaming`` the streaming loop's
    (:class:`StreamingGRPOTrainer`)."""
    return StreamingGRPOTrainer if cfg.grpo.streaming else GRPOTrainer


def run(cfg: TrainConfig) -> Dict[str, Any]:
    """``mcore-rl train`` with ``algorithm: grpo``: build, train, print the summary. Returns
    the summary dict."""
    return run_trainer(trainer_class(cfg), cfg)


def evaluate(cfg: TrainConfig) -> Dict[str, Any]:
    """``mcore-rl eval`` with ``algorithm: grpo``: :meth:`RLTrainer.evaluate`, printed."""
    return run_eval(trainer_class(cfg), cfg)
