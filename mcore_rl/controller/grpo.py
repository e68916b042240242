"""The single controller of a GRPO run.

Per RL step: sample prompts -> generate ``num_generations`` responses each (rollout backend)
-> score with the verifier -> GRPO group advantages -> old (and reference) logprobs from the
policy -> ``optimizer_steps_per_rollout`` policy updates -> refit the rollout backend with the
new weights -> log. Validation (greedy accuracy on held-out prompts) every ``grpo.val_every``
steps; checkpoints every ``checkpoint.every`` steps. An optional supervised warm start on the
task's reference answers runs first (``sft.steps``). The shared machinery is
:class:`~mcore_rl.controller.trainer.RLTrainer`.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from mcore_rl.algorithms.advantages import grpo_advantages
from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.schema import TrainConfig
from mcore_rl.controller.trainer import RLTrainer, run_eval, run_trainer
from mcore_rl.data import batch as B


class GRPOTrainer(RLTrainer):
    """GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1) on
    :class:`~mcore_rl.controller.trainer.RLTrainer`: config section ``grpo``."""

    algorithm = "grpo"

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.loss_fn = ClippedPGLoss(cfg.loss)

    def _policy_schedule(self) -> Tuple[int, int]:
        g = self.cfg.grpo
        rollout_size = g.num_prompts_per_step * g.num_generations
        return g.max_steps * g.optimizer_steps_per_rollout, rollout_size // g.optimizer_steps_per_rollout

    def rl_step(self) -> Dict[str, float]:
        """One RL step; returns its metrics."""
        g = self.cfg.grpo
        t = self.timer
        with t.phase("step"):
            rollout, reward_errors = self.generate_and_score(g.num_generations)
            adv = grpo_advantages(rollout["rewards"], g.num_generations, rollout["sample_mask"],
                                  normalize_std=g.normalize_std, leave_one_out=g.leave_one_out)
            rollout["advantages"] = adv[:, None] * rollout["token_mask"]
            with t.phase("logprobs"):
                rollout["prev_logprobs"] = self._logprobs(rollout)
                if self.use_reference:
                    rollout["reference_logprobs"] = self._logprobs(rollout, "get_reference_logprobs")
            with t.phase("train"):
                train_metrics = [self._train(part, self.loss_fn)
                                 for part in B.shard(rollout, g.optimizer_steps_per_rollout)]
            with t.phase("refit"):
                refit = self.refit()
        metrics = self.rollout_metrics(rollout, reward_errors)
        for k in train_metrics[-1]:
            metrics[f"train/{k}"] = sum(m[k] for m in train_metrics) / len(train_metrics)
        metrics.update(refit)
        metrics.update(self.timer.pop())
        return metrics


def trainer_class(cfg: TrainConfig):
    """:class:`GRPOTrainer`, or with ``grpo.streaming`` the streaming loop's
    (:class:`~mcore_rl.controller.streaming.StreamingGRPOTrainer`)."""
    if cfg.grpo.streaming:
        from mcore_rl.controller.streaming import StreamingGRPOTrainer

        return StreamingGRPOTrainer
    return GRPOTrainer


def run(cfg: TrainConfig) -> Dict[str, Any]:
    """``mcore-rl train`` with ``algorithm: grpo``: build, train, print the summary. Returns
    the summary dict."""
    return run_trainer(trainer_class(cfg), cfg)


def evaluate(cfg: TrainConfig) -> Dict[str, Any]:
    """``mcore-rl eval`` with ``algorithm: grpo``: :meth:`RLTrainer.evaluate`, printed."""
    return run_eval(trainer_class(cfg), cfg)
