"""PPO as the loops call it (``algorithm: ppo``): :class:`PPO`.

Per RL step (:class:`~mcore_rl.controller.loops.SyncLoop`): sample prompts -> generate
``ppo.num_generations`` responses each -> score with the verifier -> old (and reference)
logprobs from the policy and values from the critic -> token-level rewards (the outcome reward
at the last response token, ``-beta * KL_t`` on every response token when
``ppo.reward_kl_coef > 0``) -> GAE advantages and returns (returns taken before the advantages
are whitened) -> ``ppo.ppo_epochs`` passes over shuffled mini-batches, each a critic update
then a policy update (the policy stays frozen for the first ``ppo.critic_warmup_steps`` steps)
-> refit -> log. Validation, logging, warm start and checkpoints (policy and critic) are those
of :class:`~mcore_rl.controller.trainer.RLTrainer`. With ``ppo.streaming`` the streaming loop
(:mod:`mcore_rl.controller.streaming`) runs the same step on rollouts as they finish: a chunk's
values come from the critic with its logprobs, then its token rewards, GAE advantages and
returns (unwhitened: load-time check); one epoch, one mini-batch; the critic's split step runs
in every RL step, the policy's after ``ppo.critic_warmup_steps`` (the policy version counts the
policy's updates, so the warm-up's rollouts are not stale).

After a supervised warm start the critic's backbone takes the warm-started policy's weights
(unless ``value.hf_path`` names a checkpoint of its own); its value head stays fresh.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from mcore_rl.algorithms.advantages import gae, masked_whiten
from mcore_rl.algorithms.kl import kl_estimate
from mcore_rl.algorithms.losses import ClippedValueLoss, valid_token_mask
from mcore_rl.algorithms.ppo import explained_variance, token_level_rewards
from mcore_rl.algorithms.registry import build_policy_loss
from mcore_rl.config.schema import TrainConfig
from mcore_rl.controller.algorithm import Algorithm, SplitStep
from mcore_rl.controller.trainer import step_seed
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import DataParallelGroup
from mcore_rl.workers.interfaces import PolicyAPI, ValueAPI

if TYPE_CHECKING:
    from mcore_rl.controller.trainer import RLTrainer


class PPO(Algorithm):
    """PPO with a Megatron critic (:class:`~mcore_rl.workers.value.ValueWorker`): config
    sections ``ppo`` and ``value``; worker groups ``policy`` and ``value`` (the critic, on the
    policy's GPUs or GPUs of its own: ``cluster.placement``).

    Attributes:
        loss_fn: the policy loss (``loss.name``).
        value_loss_fn: the critic's clipped value loss (``value.loss``).
    """

    name = "ppo"
    group_names = ("policy", "value")

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.loss_fn = build_policy_loss(cfg)
        self.value_loss_fn = ClippedValueLoss(cfg.value.loss)

    def policy_schedule(self) -> Tuple[int, int]:
        """``ppo_epochs x num_mini_batches`` optimizer steps per RL step (the critic's too)."""
        p = self.cfg.ppo
        samples = p.num_prompts_per_step * p.num_generations
        return p.max_steps * p.ppo_epochs * p.num_mini_batches, samples // p.num_mini_batches

    def needs_reference(self) -> bool:
        """A KL term in the loss (``loss.kl_coef``) or in the reward (``ppo.reward_kl_coef``)."""
        return self.cfg.loss.kl_coef > 0 or self.cfg.ppo.reward_kl_coef > 0

    def build_groups(self, trainer: "RLTrainer") -> Dict[str, DataParallelGroup]:
        """The critic, ``value``: :class:`~mcore_rl.workers.value.ValueWorker` of ``value.*``
        on the policy's schedule."""
        from mcore_rl.workers.value import ValueWorker

        v = self.cfg.value
        return {"value": trainer.megatron_group(
            "value", ValueWorker, v.megatron, v.optimizer, *self.policy_schedule(),
            hf_path=v.hf_path or self.cfg.model.hf_path, head_fp32=v.head_fp32,
            sequence_packing=v.sequence_packing)}

    def warm_started(self, trainer: "RLTrainer") -> None:
        """The critic's backbone takes the warm-started policy's weights (unless
        ``value.hf_path`` is set)."""
        if not self.cfg.value.hf_path:
            weights = trainer.policy.call(PolicyAPI).get_hf_weights()[0]
            trainer.groups["value"].call(ValueAPI).load_backbone(weights)

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

    def mini_batches(self, rollout: B.Batch, step: int, epoch: int) -> List[B.Batch]:
        """The rollout's rows shuffled (seeded by run seed, RL step ``step`` and epoch) and cut into
        ``ppo.num_mini_batches`` mini-batches."""
        g = torch.Generator().manual_seed(step_seed(self.cfg.run.seed, step, salt=1 + epoch))
        order = torch.randperm(B.batch_size(rollout), generator=g)
        return B.shard(B.select(rollout, order), self.cfg.ppo.num_mini_batches)

    # ------------------------------------------------------------------ synchronous loop
    def rollout_forwards(self, trainer: "RLTrainer", rollout: B.Batch) -> None:
        """The critic's values of the rollout, ``prev_values`` (timed as ``values``)."""
        with trainer.timer.phase("values"):
            rollout["prev_values"] = trainer.groups["value"].gather_rows(ValueAPI).get_values(
                rollout, self.cfg.value.values_micro_batch_size)

    def set_advantages(self, rollout: B.Batch) -> None:
        """:meth:`compute_advantages`."""
        self.compute_advantages(rollout)

    def trains_policy(self, step: int) -> bool:
        """After the critic's warm-up (``ppo.critic_warmup_steps``)."""
        return step >= self.cfg.ppo.critic_warmup_steps

    def train_step(self, trainer: "RLTrainer", rollout: B.Batch) -> Dict[str, float]:
        """``ppo.ppo_epochs`` passes over :meth:`mini_batches`, each a critic update then, after
        the warm-up, a policy update; their mean metrics as ``critic/<metric>`` and
        ``train/<metric>``. The two updates depend on the rollout only, not on each other, so
        with ``cluster.placement=separate`` (critic and policy on GPUs of their own) every
        critic update is sent at once (the critic's ranks run them in order) and the policy
        trains meanwhile: ``train`` times the policy's updates, ``train_critic`` what is left
        of the critic's after them. Colocated (one GPU each rank, two processes time-slicing
        it) they alternate: ``train_critic`` then ``train`` per mini-batch. The numbers are
        the same either way."""
        p, t = self.cfg.ppo, trainer.timer
        train_policy = self.trains_policy(trainer.step)
        value = trainer.groups["value"]
        parts = [part for epoch in range(p.ppo_epochs)
                 for part in self.mini_batches(rollout, trainer.step, epoch)]

        def critic(part: B.Batch):
            return value.train_async(part, self.value_loss_fn, self.cfg.value.micro_batch_size)

        value_metrics, policy_metrics = [], []
        if self.cfg.cluster.placement == "separate":
            pending = [critic(part) for part in parts]
            if train_policy:
                with t.phase("train"):
                    policy_metrics = [trainer.train_policy(part, self.loss_fn) for part in parts]
            with t.phase("train_critic"):
                value_metrics = [f.result() for f in pending]
        else:
            for part in parts:
                with t.phase("train_critic"):
                    value_metrics.append(critic(part).result())
                if train_policy:
                    with t.phase("train"):
                        policy_metrics.append(trainer.train_policy(part, self.loss_fn))
        return {**_mean_metrics(value_metrics, "critic/"), **_mean_metrics(policy_metrics, "train/")}

    def batch_metrics(self, rollout: B.Batch) -> Dict[str, float]:
        """:meth:`critic_metrics`."""
        return self.critic_metrics(rollout)

    # ------------------------------------------------------------------ streaming
    def chunk_calls(self, trainer: "RLTrainer", chunk: B.Batch,
                    dp_ranks: Dict[str, int]) -> Dict[str, Future]:
        """The critic's values of the chunk (``prev_values``) on its DP rank."""
        value = trainer.groups["value"].call_per_dp_async(ValueAPI, dp_ranks=[dp_ranks["value"]])
        return {"prev_values": value.get_values([[chunk, self.cfg.value.values_micro_batch_size]])}

    def prepare_chunk(self, chunk: B.Batch) -> None:
        """The chunk's token rewards, GAE advantages and returns (:meth:`compute_advantages`,
        exact per chunk: GAE runs per sequence, unwhitened)."""
        self.compute_advantages(chunk)

    def split_steps(self, trainer: "RLTrainer", step: int) -> Dict[str, SplitStep]:
        """The critic's split step, then (after the warm-up) the policy's."""
        critic = {"value": SplitStep(trainer.groups["value"], self.value_loss_fn,
                                     self.cfg.value.micro_batch_size, "critic/")}
        if not self.trains_policy(step):
            return critic
        return {**critic, **super().split_steps(trainer, step)}

    def policy_version(self, step: int) -> int:
        """The RL steps after the critic's warm-up: the warm-up does not update the policy."""
        return max(0, step - self.cfg.ppo.critic_warmup_steps)


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
