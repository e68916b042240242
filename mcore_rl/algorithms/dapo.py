"""DAPO's rollout-side techniques (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", arXiv:2503.14476): dynamic sampling (sec. 3.2), overlong reward
shaping and overlong filtering (sec. 3.4). Its loss-side techniques are
:class:`~mcore_rl.algorithms.losses.ClippedPGLoss`'s clip-higher (``loss.ratio_clip_high``)
and token-level loss (``loss.aggregation=token-mean``).

Functions over scored rollouts (``rewards [B]``, ``sample_mask [B]``, rows of a prompt's group
adjacent), so any controller loop (synchronous or streaming) can call them.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from mcore_rl.data import batch as B


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer_length: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (sec. 3.4, eq. 13), added to the outcome reward.

    With ``L_max = max_length`` and ``L_cache = buffer_length``: 0 for ``|y| <= L_max -
    L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` inside the buffer; ``-1`` beyond
    ``L_max``; all times ``penalty_factor``.

    Args:
        response_lengths: ``[B]`` int, tokens of each response (eos included).
        max_length: ``L_max`` (config ``generation.max_new_tokens``).
        buffer_length: ``L_cache`` >= 0 (``grpo.overlong_buffer_length``); 0 gives zeros.
        penalty_factor: scale of the penalty (``grpo.overlong_penalty_factor``).

    Returns:
        ``[B]`` float32 penalties in ``[-penalty_factor, 0]``.

    Raises:
        ValueError: ``buffer_length`` outside ``[0, max_length]``.
    """
    if not 0 <= buffer_length <= max_length:
        raise ValueError(f"grpo.overlong_buffer_length ({buffer_length}) must be in [0, "
                         f"generation.max_new_tokens ({max_length})]")
    lengths = response_lengths.float()
    if buffer_length == 0:
        return torch.zeros_like(lengths)
    start = max_length - buffer_length
    penalty = ((start - lengths) / buffer_length).clamp(min=-1.0, max=0.0)
    return penalty * penalty_factor


def informative_groups(rewards: torch.Tensor, sample_mask: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """Prompt groups whose valid rewards are not all equal: the groups DAPO's dynamic sampling
    keeps (sec. 3.2: the constraint ``0 < |{o_i correct}| < G`` of its objective, for any
    reward: an all-equal group has zero advantage and gives no policy gradient).

    Args:
        rewards: ``[B]`` float32; ``sample_mask``: ``[B]`` (0: the sample is ignored);
        group_size: samples per group, dividing B.

    Returns:
        ``[B / group_size]`` bool, True for a group with two different valid rewards.

    Raises:
        ValueError: B not divisible by ``group_size`` or shapes that differ.
    """
    if rewards.dim() != 1 or sample_mask.shape != rewards.shape or rewards.numel() % group_size:
        raise ValueError(f"informative_groups: rewards {tuple(rewards.shape)} and sample_mask "
                         f"{tuple(sample_mask.shape)} must be [B] with B divisible by {group_size}")
    r = rewards.float().view(-1, group_size)
    valid = sample_mask.view(-1, group_size) > 0
    high = torch.where(valid, r, torch.full_like(r, -torch.inf)).max(dim=1).values
    low = torch.where(valid, r, torch.full_like(r, torch.inf)).min(dim=1).values
    return high > low


def dynamic_sampling(draw: Callable[[], B.Batch], num_groups: int, group_size: int,
                     max_tries: int) -> Tuple[B.Batch, Dict[str, float]]:
    """DAPO's dynamic sampling (sec. 3.2): draw scored rollouts and keep their informative
    groups (:func:`informative_groups`) until ``num_groups`` are kept, at most ``max_tries``
    draws. When the draws run out first, the batch is filled with the dropped groups, latest
    draw first (they train with zero advantage, so the batch keeps its size, its LR-schedule
    increment and its split into optimizer steps); verl raises there instead.

    Args:
        draw: returns a fresh scored rollout of whole groups (``rewards``, ``sample_mask``).
        num_groups: groups the batch needs (``grpo.num_prompts_per_step``).
        group_size: rows per group (``grpo.num_generations``).
        max_tries: draws at most (``grpo.dynamic_sampling_max_tries``).

    Returns:
        ``(batch, metrics)``: ``num_groups * group_size`` rows, the kept groups in draw order,
        then any fillers; metrics ``dynamic_sampling_tries`` (draws made),
        ``dynamic_sampling_kept_fraction`` (informative groups / groups drawn) and
        ``dynamic_sampling_filled`` (filler groups).

    Raises:
        ValueError: ``max_tries < 1``, or a draw's rows are not whole groups.
    """
    if max_tries < 1:
        raise ValueError(f"grpo.dynamic_sampling_max_tries must be >= 1 (got {max_tries})")
    kept: List[B.Batch] = []
    dropped: List[B.Batch] = []
    num_kept = drawn = informative_count = tries = 0
    while num_kept < num_groups and tries < max_tries:
        rollout = draw()
        tries += 1
        informative = informative_groups(rollout["rewards"], rollout["sample_mask"], group_size)
        drawn += informative.numel()
        informative_count += int(informative.sum())
        rows = informative.repeat_interleave(group_size)
        take = torch.nonzero(rows).squeeze(1)[:(num_groups - num_kept) * group_size]
        kept.append(B.select(rollout, take))
        dropped.insert(0, B.select(rollout, torch.nonzero(~rows).squeeze(1)))
        num_kept += take.numel() // group_size
    filled = num_groups - num_kept
    if filled:
        kept.append(B.select(B.concat(dropped), slice(0, filled * group_size)))
    metrics = {"dynamic_sampling_tries": float(tries),
               "dynamic_sampling_kept_fraction": informative_count / drawn,
               "dynamic_sampling_filled": float(filled)}
    return B.concat(kept), metrics
