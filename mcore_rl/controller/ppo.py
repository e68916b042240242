"""The single controller of a PPO run (``algorithm: ppo``).

Per RL step: sample prompts -> generate ``ppo.num_generations`` responses each -> score with
the verifier -> old (and reference) logprobs from the policy and values from the critic ->
token-level rewards (the outcome reward at the last response token, ``-beta * KL_t`` on every
response token when ``ppo.reward_kl_coef > 0``) -> GAE advantages and returns (returns taken
before the advantages are whitened) -> ``ppo.ppo_epochs`` passes over shuffled mini-batches,
each a critic update then a policy update (the policy stays frozen for the first
``ppo.critic_warmup_steps`` steps) -> refit -> log. Validation, logging, warm start and
checkpoints (policy and critic) are those of :class:`~mcore_rl.controller.trainer.RLTrainer`.
With ``ppo.streaming`` the streaming loop (:mod:`mcore_rl.controller.streaming`) runs the same
step on rollouts as they finish: one epoch, one mini-batch, unwhitened advantages.

After a supervised warm start the critic's backbone takes the warm-started policy's weights
(unless ``value.hf_path`` names a checkpoint of its own); its value head stays fresh.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Tuple

import torch

from mcore_rl.algorithms.advantages import gae, masked_whiten
from mcore_rl.algorithms.kl import kl_estimate
from mcore_rl.algorithms.losses import ClippedValueLoss, valid_token_mask
from mcore_rl.algorithms.ppo import explained_variance, token_level_rewards
from mcore_rl.algorithms.registry import build_policy_loss
from mcore_rl.config.schema import TrainConfig
from mcore_rl.controller.streaming import SplitStep, StreamingLoop
from mcore_rl.controller.trainer import RLTrainer, run_eval, run_trainer, step_seed
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import DataParallelGroup
from mcore_rl.utils.logging import RunLogger


class PPOTrainer(RLTrainer):
    """PPO with a Megatron critic (:class:`~mcore_rl.workers.value.ValueWorker`): config
    sections ``ppo`` and ``value``.

    Attributes:
        value: the critic's :class:`~mcore_rl.distributed.worker_group.DataParallelGroup`,
            on the policy's GPUs or GPUs of its own (``cluster.placement``).
    """

    algorithm = "ppo"
    group_names = ("policy", "value")

    def __init__(self, cfg: TrainConfig):
        from mcore_rl.workers.value import ValueWorker

        super().__init__(cfg)
        v = cfg.value
        self.value = self._megatron_group(
            "value", ValueWorker, v.megatron, v.optimizer, *self._policy_schedule(),
            hf_path=v.hf_path or cfg.model.hf_path, head_fp32=v.head_fp32,
            sequence_packing=v.sequence_packing)
        self.loss_fn = build_policy_loss(cfg)
        self.value_loss_fn = ClippedValueLoss(v.loss)

    def _policy_schedule(self) -> Tuple[int, int]:
        p = self.cfg.ppo
        samples = p.num_prompts_per_step * p.num_generations
        return p.max_steps * p.ppo_epochs * p.num_mini_batches, samples // p.num_mini_batches

    def _needs_reference(self) -> bool:
        return self.cfg.loss.kl_coef > 0 or self.cfg.ppo.reward_kl_coef > 0

    def _groups(self) -> Dict[str, DataParallelGroup]:
        return {"policy": self.policy, "value": self.value}

    def warm_start(self, logger: RunLogger) -> None:
        """The policy's warm start (:meth:`RLTrainer.warm_start`), then the critic's backbone
        takes the warm-started weights (unless ``value.hf_path`` is set)."""
        super().warm_start(logger)
        if not self.cfg.value.hf_path:
            self.value.call("load_backbone", self.policy.call("get_hf_weights")[0])

    # ------------------------------------------------------------------ advantages
    def compute_advantages(self, rollout: B.Batch) -> None:
        """Token rewards, GAE advantages and returns of a rollout that has ``rewards``,
        ``prev_logprobs``, ``prev_values`` (and ``reference_logprobs`` when
        ``ppo.reward_kl_coef > 0``); adds ``token_rewards``, ``returns`` and ``advantages``
        (all ``[B, S]`` float32, 0 off the valid tokens). The returns are taken before the
        advantages are whitened (``ppo.whiten_advantages``: over the rollout's valid tokens, so
        a whitened rollout must be the whole batch); without whitening every row's values
        depend on that row alone (GAE runs per sequence), so any split of the batch into parts
        gives the same rows."""
        p = self.cfg.ppo
        mask = valid_token_mask(rollout)
        rewards = token_level_rewards(rollout["rewards"], mask, _reward_kl(rollout, mask, p),
                                      p.reward_kl_coef)
        advantages, returns = gae(rewards, rollout["prev_values"], mask, p.gamma, p.lam)
        if p.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        rollout["token_rewards"] = rewards
        rollout["returns"] = returns * mask
        rollout["advantages"] = advantages * mask

    def critic_metrics(self, rollout: B.Batch) -> Dict[str, float]:
        """The critic's and the rewards' figures on a rollout that went through
        :meth:`compute_advantages`: ``critic/explained_variance`` against the GAE returns (the
        critic's targets; a lower ``ppo.lam`` mixes more of the critic's own values into them),
        ``critic/explained_variance_mc`` against the Monte Carlo returns (``lam = 1``: the
        discounted reward-to-go, independent of ``ppo.lam``), the means of the values, returns
        and absolute advantages over the valid tokens, and ``train/reward_kl`` (per token) with
        a reward KL."""
        p = self.cfg.ppo
        mask = valid_token_mask(rollout)
        values, returns = rollout["prev_values"], rollout["returns"]
        mc_returns = gae(rollout["token_rewards"], values, mask, p.gamma, 1.0)[1]
        valid = mask > 0
        v = values[valid]
        out = {
            "critic/explained_variance": explained_variance(values, returns, mask),
            "critic/explained_variance_mc": explained_variance(values, mc_returns, mask),
            "critic/value_mean": float(v.mean()),
            "critic/value_std": float(v.std()) if v.numel() > 1 else 0.0,
            "critic/returns_mean": float(returns[valid].mean()),
            "critic/advantages_abs_mean": float(rollout["advantages"][valid].abs().mean()),
        }
        kl = _reward_kl(rollout, mask, p)
        if kl is not None:
            out["train/reward_kl"] = float(kl[valid].mean())
        return out

    # ------------------------------------------------------------------ the step
    def _mini_batches(self, rollout: B.Batch, epoch: int) -> List[B.Batch]:
        """The rollout's rows shuffled (seeded by run seed, step and epoch) and cut into
        ``ppo.num_mini_batches`` mini-batches."""
        g = torch.Generator().manual_seed(step_seed(self.cfg.run.seed, self.step, salt=1 + epoch))
        order = torch.randperm(B.batch_size(rollout), generator=g)
        return B.shard(B.select(rollout, order), self.cfg.ppo.num_mini_batches)

    def rl_step(self) -> Dict[str, float]:
        """One RL step; returns its metrics (``critic/*`` for the critic, ``train/*`` for
        rewards and the policy, as GRPO's)."""
        cfg, p = self.cfg, self.cfg.ppo
        t = self.timer
        train_policy = self.step >= p.critic_warmup_steps
        with t.phase("step"):
            # Scored in the reward pool while the policy and the critic run their forwards.
            rollout, pending = self.generate_and_submit(p.num_generations)
            with t.phase("logprobs"):
                rollout["prev_logprobs"] = self._logprobs(rollout)
                if self.use_reference:
                    rollout["reference_logprobs"] = self._logprobs(rollout, "get_reference_logprobs")
            self.check_logprob_budget(rollout)  # before the optimizer steps: may stop the run
            with t.phase("values"):
                rollout["prev_values"] = self.value.gather_rows(
                    "get_values", rollout, cfg.value.values_micro_batch_size)
            reward_errors = self.collect_rewards(rollout, pending)
            self.compute_advantages(rollout)
            value_metrics, policy_metrics = [], []
            for epoch in range(p.ppo_epochs):
                for part in self._mini_batches(rollout, epoch):
                    with t.phase("train_critic"):
                        value_metrics.append(self.value.train(part, self.value_loss_fn,
                                                              cfg.value.micro_batch_size))
                    if train_policy:
                        with t.phase("train"):
                            policy_metrics.append(self._train(part, self.loss_fn))
            if train_policy:
                with t.phase("refit"):
                    refit = self.refit()
        metrics = self.rollout_metrics(rollout, reward_errors, t.seconds("generation"))
        metrics.update(self.critic_metrics(rollout))
        metrics.update(_mean_metrics(value_metrics, "critic/"))
        metrics.update(_mean_metrics(policy_metrics, "train/"))
        if train_policy:
            metrics.update(refit)
        metrics.update(self.timer.pop())
        metrics.update(self.reward_timing())
        return metrics


def _reward_kl(rollout: B.Batch, mask: torch.Tensor, p) -> Optional[torch.Tensor]:
    """The reward's per-token KL term ``[B, S]`` float32 (``ppo.reward_kl_estimator`` of
    ``prev_logprobs`` against ``reference_logprobs``, 0 off ``mask``), or None without a
    reference (``p``: the ``ppo`` section)."""
    if "reference_logprobs" not in rollout:
        return None
    return kl_estimate(rollout["prev_logprobs"], rollout["reference_logprobs"],
                       p.reward_kl_estimator) * mask


def _mean_metrics(metrics: List[Dict[str, float]], prefix: str) -> Dict[str, float]:
    """Mean of each metric over a step's optimizer steps, names prefixed."""
    if not metrics:
        return {}
    return {f"{prefix}{k}": sum(m[k] for m in metrics) / len(metrics) for k in metrics[-1]}


class StreamingPPOTrainer(StreamingLoop, PPOTrainer):
    """PPO (:class:`PPOTrainer`) with the streaming loop (``ppo.streaming``): a chunk's values
    come from the critic with its logprobs, then its token rewards, GAE advantages and returns
    (:meth:`PPOTrainer.compute_advantages`, unwhitened: load-time check); the critic's split
    step runs in every RL step, the policy's after ``ppo.critic_warmup_steps`` (the policy
    version counts the policy's updates, so the warm-up's rollouts are not stale)."""

    def _chunk_calls(self, chunk: B.Batch, dp_ranks: Dict[str, int]) -> Dict[str, Future]:
        calls = super()._chunk_calls(chunk, dp_ranks)
        calls["prev_values"] = self.value.call_per_dp_async(
            "get_values", [[chunk, self.cfg.value.values_micro_batch_size]],
            dp_ranks=[dp_ranks["value"]])
        return calls

    def _prepare_chunk(self, chunk: B.Batch) -> None:
        self.compute_advantages(chunk)

    def _split_steps(self) -> Dict[str, SplitStep]:
        critic = {"value": SplitStep(self.value, self.value_loss_fn,
                                     self.cfg.value.micro_batch_size, "critic/")}
        if self.step < self.cfg.ppo.critic_warmup_steps:
            return critic
        return {**critic, **super()._split_steps()}

    def _policy_version(self, step: int) -> int:
        return max(0, step - self.cfg.ppo.critic_warmup_steps)

    def _batch_metrics(self, rollout: B.Batch) -> Dict[str, float]:
        return self.critic_metrics(rollout)


def trainer_class(cfg: TrainConfig):
    """:class:`PPOTrainer`, or with ``ppo.streaming`` the streaming loop's
    (:class:`StreamingPPOTrainer`)."""
    return StreamingPPOTrainer if cfg.ppo.streaming else PPOTrainer


def run(cfg: TrainConfig) -> Dict[str, Any]:
    """``mcore-rl train`` with ``algorithm: ppo``: build, train, print the summary. Returns
    the summary dict."""
    return run_trainer(trainer_class(cfg), cfg)


def evaluate(cfg: TrainConfig) -> Dict[str, Any]:
    """``mcore-rl eval`` with ``algorithm: ppo``: :meth:`RLTrainer.evaluate`, printed."""
    return run_eval(trainer_class(cfg), cfg)
