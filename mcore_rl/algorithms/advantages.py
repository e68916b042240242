"""Advantage estimators: GRPO group statistics (with the RLOO and Dr. GRPO variants), GAE,
REINFORCE++'s globally whitened reward-to-go, and masked whitening.

Conventions (``docs/design.md``, "Conventions"): tensors are ``[B]`` per sample or ``[B, S]`` per token, float32;
``mask`` is 1 on response tokens; a sample with ``sample_mask = 0`` is dropped.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from mcore_rl.algorithms.ppo import token_level_rewards
from mcore_rl.config.checks import check_value


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    sample_mask: Optional[torch.Tensor] = None,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample advantages from the statistics of each prompt's group of samples.

    Rows ``[g*group_size, (g+1)*group_size)`` are the ``group_size`` samples of prompt ``g``.
    Statistics use the valid members (``sample_mask = 1``) of a group only, ``n`` of them:

    * baseline ``b_i``: the group mean (GRPO, Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300,
      sec. 4.1.2, outcome supervision: ``(r_i - mean(r)) / std(r)``), or with ``leave_one_out``
      the mean of the OTHER valid members, ``(sum - r_i) / (n - 1)`` (RLOO, Ahmadian et al.
      2024, "Back to Basics", arXiv:2402.14740);
    * ``A_i = (r_i - b_i) / (std + eps)`` with ``std`` the UNBIASED standard deviation of the
      group's valid rewards (``torch.std``'s default, as NeMo RL and TRL use); with
      ``normalize_std=False`` the division is skipped, ``A_i = r_i - b_i`` (Dr. GRPO, Liu et
      al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    A group with fewer than two valid samples gives 0 to all its members; masked samples get 0.

    Args:
        rewards: ``[B]`` float32 scalar reward per sample.
        group_size: samples per prompt (config ``grpo.num_generations``, >= 2: a group of one
            has no baseline); must divide B.
        sample_mask: ``[B]`` float (1 keep, 0 drop), or None for all valid.
        normalize_std: divide by the group std (GRPO) or not (Dr. GRPO).
        leave_one_out: leave-one-out baseline (RLOO) instead of the group mean.
        eps: added to the std in the denominator.

    Returns:
        ``[B]`` float32 advantages (broadcast over response tokens by the caller).

    Raises:
        ValueError: ``rewards`` not 1-D, B not divisible by ``group_size`` (names
            ``grpo.num_generations``), or ``sample_mask`` of another shape; ``ConfigError`` (a
            ``ValueError``) for ``group_size`` outside the bound of ``grpo.num_generations``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"grpo_advantages: rewards must be [B], got shape {tuple(rewards.shape)}")
    check_value("grpo.num_generations", group_size)
    num_samples = rewards.shape[0]
    if num_samples % group_size != 0:
        raise ValueError(f"grpo.num_generations: batch of {num_samples} samples is not divisible "
                         f"into groups of {group_size}")
    if sample_mask is None:
        sample_mask = torch.ones_like(rewards)
    elif sample_mask.shape != rewards.shape:
        raise ValueError(f"grpo_advantages: sample_mask shape {tuple(sample_mask.shape)} differs "
                         f"from rewards shape {tuple(rewards.shape)}")

    r = rewards.float().view(-1, group_size)
    m = (sample_mask.view(-1, group_size) > 0).to(r.dtype)
    r = torch.where(m > 0, r, torch.zeros_like(r))  # masked rewards (even NaN) never enter
    n = m.sum(dim=1, keepdim=True)
    total = r.sum(dim=1, keepdim=True)
    mean = total / n.clamp(min=1)
    if leave_one_out:
        baseline = (total - r) / (n - 1).clamp(min=1)
    else:
        baseline = mean
    advantages = r - baseline
    if normalize_std:
        var = (m * (r - mean).square()).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
        advantages = advantages / (var.sqrt() + eps)
    advantages = torch.where((m > 0) & (n > 1), advantages, torch.zeros_like(advantages))
    return advantages.reshape(num_samples)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the masked tokens of each row.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation" (arXiv:1506.02438), eq. 16: ``A_t = sum_l (gamma*lambda)^l delta_{t+l}`` with
    ``delta_t = r_t + gamma*V_{t+1} - V_t``, where ``t, t+1, ...`` run over the positions with
    ``mask = 1`` only (holes in the mask are skipped) and ``V`` after the last one is 0.
    Computed by the recursion of ``docs/design.md`` ("Token rewards and GAE"), for
    t = S-1 .. 0 from ``nextV = lastgae = 0``::

        delta = r_t + gamma*nextV - V_t;  g = delta + gamma*lambda*lastgae
        nextV = m_t*V_t + (1-m_t)*nextV;  lastgae = m_t*g + (1-m_t)*lastgae;  A_t = lastgae

    Args:
        token_rewards: ``[B, S]`` float32 per-token rewards; positions with ``mask = 0`` are
            ignored.
        values: ``[B, S]`` float32, ``V(state before token t)``.
        mask: ``[B, S]`` float, 1 on response tokens.
        gamma: discount factor in [0, 1] (config ``ppo.gamma``).
        lam: GAE lambda in [0, 1] (config ``ppo.lam``).

    Returns:
        ``(advantages, returns)``, both ``[B, S]`` float32, ``returns = advantages + values``
        (before any whitening). Only positions with ``mask = 1`` are meaningful: a masked
        position holds the carried-over value of the next valid one (0 after the last).

    Raises:
        ValueError: the three tensors differ in shape or are not 2-D; ``ConfigError`` (a
            ``ValueError``) for ``gamma`` or ``lam`` outside [0, 1] (the bounds of ``ppo.gamma``
            and ``ppo.lam``).
    """
    check_value("ppo.gamma", gamma)
    check_value("ppo.lam", lam)
    if token_rewards.dim() != 2 or token_rewards.shape != values.shape or values.shape != mask.shape:
        raise ValueError(f"gae: token_rewards {tuple(token_rewards.shape)}, values "
                         f"{tuple(values.shape)} and mask {tuple(mask.shape)} must be equal [B, S]")
    rewards, values, mask = token_rewards.float(), values.float(), mask.float()
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    advantages = torch.empty_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        m_t, v_t = mask[:, t], values[:, t]
        delta = rewards[:, t] + gamma * next_value - v_t
        g = delta + gamma * lam * last_gae
        next_value = m_t * v_t + (1 - m_t) * next_value
        last_gae = m_t * g + (1 - m_t) * last_gae
        advantages[:, t] = last_gae
    return advantages, advantages + values


def reinforce_plus_plus_advantages(rewards: torch.Tensor, mask: torch.Tensor,
                                   kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                                   gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025, "REINFORCE++", arXiv:2501.03262, sec. 3): the
    reward-to-go of KL-shaped token rewards, normalized over the whole batch.

    Token rewards ``r_t = -kl_coef * KL_t`` on every valid token plus the sample's outcome
    reward on its last valid token (:func:`mcore_rl.algorithms.ppo.token_level_rewards`, the
    paper's token-level KL penalty); ``A_t = sum_{s >= t} gamma^(s-t) r_s`` over the valid
    positions (GAE with ``V = 0`` and ``lambda = 1``: :func:`gae`); then
    ``A = (A - mean) / std`` with the mean and std over every valid token of the batch (the
    paper's global advantage normalization, :func:`masked_whiten`), no critic and no group.

    Args:
        rewards: ``[B]`` float32 outcome reward per sample.
        mask: ``[B, S]`` float, 1 on valid response tokens (holes allowed: a hole neither
            earns nor passes on reward; the last 1 of a row takes the outcome reward).
        kl: ``[B, S]`` float32 per-token KL estimate (required when ``kl_coef > 0``).
        kl_coef: ``beta`` >= 0 (config ``grpo.reward_kl_coef``).
        gamma: discount in [0, 1] (REINFORCE++ uses 1).

    Returns:
        ``[B, S]`` float32, 0 where ``mask = 0``.

    Raises:
        ValueError: shapes that do not fit, ``kl_coef > 0`` without ``kl``, or fewer than 2
            valid tokens in the batch.
    """
    mask = (mask > 0).float()
    token_rewards = token_level_rewards(rewards, mask, kl, kl_coef)
    returns = gae(token_rewards, torch.zeros_like(mask), mask, gamma, 1.0)[0]
    return masked_whiten(returns, mask) * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Normalize ``x`` to zero mean and unit variance over the positions with ``mask = 1``.

    ``(x - mean) / sqrt(var + eps)`` with the masked mean and the UNBIASED masked variance (as
    TRL's and verl's ``masked_whiten``); with ``shift_mean=False`` the mean is added back (only
    the scale changes).

    Args:
        x: ``[B, S]`` (any shape) float32.
        mask: same shape as ``x``, 1 on the positions to use.
        shift_mean: subtract the mean (True) or keep it (False).
        eps: added to the variance.

    Returns:
        Tensor of ``x``'s shape; positions with ``mask = 0`` are transformed too and carry no
        meaning.

    Raises:
        ValueError: shapes differ, or fewer than 2 positions have ``mask = 1``.
    """
    if x.shape != mask.shape:
        raise ValueError(f"masked_whiten: x {tuple(x.shape)} and mask {tuple(mask.shape)} differ")
    mask = mask.to(x.dtype)
    n = mask.sum()
    if n < 2:
        raise ValueError(f"masked_whiten: needs at least 2 valid positions, got {int(n)}")
    mean = (x * mask).sum() / n
    var = (mask * (x - mean).square()).sum() / (n - 1)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean
