"""The advantage estimators of the GRPO loop, by the names of ``grpo.advantage_estimator``
(:mod:`mcore_rl.algorithms.registry`).

Each maps a scored rollout and the run's config to per-token advantages. The rollout has
``rewards [B]``, ``sample_mask [B]``, ``token_mask [B, S]`` (rows of a prompt's group adjacent,
``grpo.num_generations`` of them), ``prev_logprobs [B, S]`` and, when the policy keeps a
reference, ``reference_logprobs [B, S]``. Each returns ``[B, S]`` float32 advantages, 0 off
the response tokens.
"""

from __future__ import annotations

from typing import Dict

import torch

from mcore_rl.algorithms.advantages import grpo_advantages, reinforce_plus_plus_advantages
from mcore_rl.algorithms.kl import kl_estimate
from mcore_rl.algorithms.losses import valid_token_mask
from mcore_rl.config.schema import TrainConfig

Rollout = Dict[str, torch.Tensor]


def grpo(rollout: Rollout, cfg: TrainConfig) -> torch.Tensor:
    """GRPO's group-normalized outcome advantage (Shao et al. 2024, arXiv:2402.03300, sec.
    4.1.2), ``(r - mean) / std`` per prompt group, or ``r - mean`` with
    ``grpo.normalize_std=false`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, sec. 3.2), on
    every response token: :func:`~mcore_rl.algorithms.advantages.grpo_advantages`."""
    g = cfg.grpo
    adv = grpo_advantages(rollout["rewards"], g.num_generations, rollout["sample_mask"],
                          normalize_std=g.normalize_std)
    return adv[:, None] * rollout["token_mask"]


def rloo(rollout: Rollout, cfg: TrainConfig) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740, sec. 3.2, the
    REINFORCE leave-one-out estimator of Kool et al. 2019): ``r_i - mean of the other valid
    samples of the group``, not divided by any std, on every response token."""
    adv = grpo_advantages(rollout["rewards"], cfg.grpo.num_generations, rollout["sample_mask"],
                          normalize_std=False, leave_one_out=True)
    return adv[:, None] * rollout["token_mask"]


def reinforce_plus_plus(rollout: Rollout, cfg: TrainConfig) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): the reward-to-go of the outcome reward and a
    per-token KL penalty ``-grpo.reward_kl_coef * KL(pi_old || pi_ref)_t`` (estimator
    ``grpo.reward_kl_estimator``), whitened over the valid tokens of the whole batch:
    :func:`~mcore_rl.algorithms.advantages.reinforce_plus_plus_advantages`. Needs
    ``reference_logprobs`` when ``grpo.reward_kl_coef > 0``."""
    g = cfg.grpo
    mask = valid_token_mask(rollout)
    kl = None
    if g.reward_kl_coef > 0:
        kl = kl_estimate(rollout["prev_logprobs"], rollout["reference_logprobs"],
                         g.reward_kl_estimator) * mask
    return reinforce_plus_plus_advantages(rollout["rewards"], mask, kl, g.reward_kl_coef)
