"""GRPO as the loops call it (``algorithm: grpo``): :class:`GRPO`.

Per RL step (:class:`~mcore_rl.controller.loops.SyncLoop`): sample prompts -> generate
``num_generations`` responses each (rollout backend) -> score with the verifier in the reward
pool (:mod:`mcore_rl.rewards.pool`) while the policy computes the old (and reference)
logprobs, then collect the rewards (plus DAPO's overlong penalty; with DAPO's dynamic sampling,
scored before the logprobs, round by round until the batch holds ``num_prompts_per_step``
groups of unequal rewards) -> advantages (``grpo.advantage_estimator``) -> DAPO's overlong
filtering -> ``optimizer_steps_per_rollout`` updates with the policy loss (``loss.name``) ->
refit the rollout backend with the new weights -> log. With ``grpo.streaming`` the streaming
loop (:mod:`mcore_rl.controller.streaming`) shapes the rewards and sets the advantages of each
prompt group as it is scored (a per-group estimator: load-time check). Validation, warm start
and checkpoints are the shared machinery's (:class:`~mcore_rl.controller.trainer.RLTrainer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Tuple

from mcore_rl.algorithms import dapo
from mcore_rl.algorithms.registry import advantage_estimator, build_policy_loss
from mcore_rl.config.schema import TrainConfig
from mcore_rl.controller.algorithm import Algorithm, Sampled
from mcore_rl.data import batch as B

if TYPE_CHECKING:
    from mcore_rl.controller.trainer import RLTrainer


class GRPO(Algorithm):
    """GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1) with DAPO's
    options: config section ``grpo``, the policy's worker group only.

    Attributes:
        loss_fn: the policy loss (``loss.name``).
        estimator: the advantage estimator (``grpo.advantage_estimator``).
    """

    name = "grpo"
    group_names = ("policy",)

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.loss_fn = build_policy_loss(cfg)
        self.estimator = advantage_estimator(cfg.grpo.advantage_estimator)

    def needs_reference(self) -> bool:
        """A KL term in the loss (``loss.kl_coef``) or in the reward (``grpo.reward_kl_coef``)."""
        return self.cfg.loss.kl_coef > 0 or self.cfg.grpo.reward_kl_coef > 0

    def policy_schedule(self) -> Tuple[int, int]:
        """``optimizer_steps_per_rollout`` steps per RL step, each on that share of the
        rollout."""
        g = self.cfg.grpo
        rollout_size = g.num_prompts_per_step * g.num_generations
        return g.max_steps * g.optimizer_steps_per_rollout, rollout_size // g.optimizer_steps_per_rollout

    def sample(self, trainer: "RLTrainer") -> Sampled:
        """With ``grpo.dynamic_sampling``: rounds of prompt groups, each scored at once (and
        its rewards shaped), kept or dropped by their rewards (:func:`dapo.dynamic_sampling`;
        its metrics as ``train/dynamic_sampling_*``). Otherwise the rollout of
        :meth:`Algorithm.sample`, scored in the reward pool."""
        g = self.cfg.grpo
        if not g.dynamic_sampling:
            return super().sample(trainer)
        errors = 0

        def scored_groups() -> B.Batch:
            nonlocal errors
            rollout, round_errors = trainer.generate_and_score(g.num_generations)
            errors += round_errors
            self.shape_rewards(rollout)
            return rollout

        rollout, sampling = dapo.dynamic_sampling(
            scored_groups, g.num_prompts_per_step, g.num_generations, g.dynamic_sampling_max_tries)
        return rollout, None, errors, {f"train/{k}": v for k, v in sampling.items()}

    def shape_rewards(self, rollout: B.Batch) -> None:
        """DAPO's overlong penalty (``grpo.overlong_buffer_length``) added to ``rewards`` [B]
        in place; nothing without a buffer."""
        g = self.cfg.grpo
        if g.overlong_buffer_length:
            rollout["rewards"] = rollout["rewards"] + dapo.overlong_penalty(
                rollout["response_lengths"], self.cfg.generation.max_new_tokens,
                g.overlong_buffer_length, g.overlong_penalty_factor)

    def set_advantages(self, rollout: B.Batch) -> None:
        """``advantages`` [B, S] of ``grpo.advantage_estimator``, then DAPO's overlong filtering
        (``grpo.overlong_filtering``: truncated rows leave the loss through ``sample_mask``)."""
        rollout["advantages"] = self.estimator(rollout, self.cfg)
        if self.cfg.grpo.overlong_filtering:
            rollout["sample_mask"] = rollout["sample_mask"] * (1 - rollout["truncated"])

    def train_step(self, trainer: "RLTrainer", rollout: B.Batch) -> Dict[str, float]:
        """``grpo.optimizer_steps_per_rollout`` policy updates, one per shard of the rollout
        (timed as ``train``); their mean metrics as ``train/<metric>``."""
        with trainer.timer.phase("train"):
            metrics = [trainer.train_policy(part, self.loss_fn)
                       for part in B.shard(rollout, self.cfg.grpo.optimizer_steps_per_rollout)]
        return {f"train/{k}": sum(m[k] for m in metrics) / len(metrics) for k in metrics[-1]}

    def score_group(self, rows: B.Batch) -> None:
        """A streamed group's rewards shaped and advantages set, from its rows alone."""
        self.shape_rewards(rows)
        self.set_advantages(rows)
