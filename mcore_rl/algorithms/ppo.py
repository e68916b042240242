"""PPO's per-token quantities: token-level rewards (outcome reward plus a KL penalty) and the
critic's explained variance. GAE and whitening are in :mod:`mcore_rl.algorithms.advantages`.

Conventions (``docs/design.md``, "Token rewards and GAE"): ``[B, S]`` float32 per token, ``mask`` 1 on the valid response
tokens (:func:`mcore_rl.algorithms.losses.valid_token_mask`).
"""

from __future__ import annotations

from typing import Optional

import torch

from mcore_rl.config.checks import check_value


def token_level_rewards(rewards: torch.Tensor, mask: torch.Tensor, kl: Optional[torch.Tensor] = None,
                        kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards of a response: ``r_t = -kl_coef * KL_t`` on every valid token, plus
    the sample's scalar reward on its last valid token; ``r *= mask``.

    The KL-shaped reward of RLHF (Ziegler et al. 2019, arXiv:1909.08593, sec. 2; Ouyang et al.
    2022, arXiv:2203.02155, eq. 2), with the penalty spread over the tokens (``KL_t`` from
    :func:`mcore_rl.algorithms.kl.kl_estimate` on the old and reference logprobs) and the
    verifier's outcome reward at the end of the episode.

    Args:
        rewards: ``[B]`` float32 scalar reward per sample.
        mask: ``[B, S]`` float, 1 on valid response tokens (may have holes; the last 1 of a row
            is its last token). A row without valid tokens gets no reward.
        kl: ``[B, S]`` float32 per-token KL estimate, or None (required when ``kl_coef > 0``).
        kl_coef: ``beta`` >= 0 (config ``ppo.reward_kl_coef``).

    Returns:
        ``[B, S]`` float32, 0 where ``mask = 0``.

    Raises:
        ValueError: shapes that do not fit (``rewards [B]``, ``mask [B, S]``, ``kl [B, S]``),
            or ``kl_coef > 0`` without ``kl``; ``ConfigError`` (a ``ValueError``) for
            ``kl_coef < 0`` (the bound of ``ppo.reward_kl_coef``).
    """
    if mask.dim() != 2 or rewards.shape != mask.shape[:1]:
        raise ValueError(f"token_level_rewards: rewards must be [B] and mask [B, S]; got "
                         f"{tuple(rewards.shape)} and {tuple(mask.shape)}")
    check_value("ppo.reward_kl_coef", kl_coef)
    mask = (mask > 0).float()
    out = torch.zeros_like(mask)
    if kl_coef > 0:
        if kl is None or kl.shape != mask.shape:
            raise ValueError(f"token_level_rewards: ppo.reward_kl_coef > 0 needs kl of shape "
                             f"{tuple(mask.shape)}, got {None if kl is None else tuple(kl.shape)}")
        out = -kl_coef * torch.where(mask > 0, kl.float(), out)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values  # -1: no valid token
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] += rewards[rows].float()
    return out * mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the positions with ``mask = 1``: the share of the
    returns' variance the critic accounts for (1 perfect, 0 no better than a constant, < 0
    worse); the diagnostic of OpenAI baselines (``common/math_util.explained_variance``).

    Args:
        values: ``[B, S]`` critic values (float32).
        returns: ``[B, S]`` targets (GAE returns).
        mask: ``[B, S]`` float, 1 on the positions to use.

    Returns:
        A float; NaN when fewer than 2 positions are valid or the returns do not vary there.

    Raises:
        ValueError: shapes differ.
    """
    if not values.shape == returns.shape == mask.shape:
        raise ValueError(f"explained_variance: values {tuple(values.shape)}, returns "
                         f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must be equal")
    valid = mask > 0
    ret, err = returns[valid].double(), (returns - values)[valid].double()
    if ret.numel() < 2:
        return float("nan")
    var = ret.var()
    return float("nan") if var == 0 else float(1 - err.var() / var)
