"""Batched data: a plain ``dict[str, Tensor]`` whose tensors share the batch dimension 0.

Keys of one RL step (shapes with B samples, S tokens; right-padded):

=======================  =========  =======  ============================================
key                      shape      dtype    meaning
=======================  =========  =======  ============================================
``input_ids``            [B, S]     int64    prompt + response tokens, pad after the end
``input_lengths``        [B]        int64    valid tokens per row (prompt + response)
``prompt_lengths``       [B]        int64    prompt tokens per row
``response_lengths``     [B]        int64    response tokens per row (eos included)
``truncated``            [B]        float32  1 when the response hit the length limit
                                             without eos
``token_mask``           [B, S]     float32  1 on response tokens, 0 on prompt and padding
``sample_mask``          [B]        float32  0 drops a sample from the loss
``generation_logprobs``  [B, S]     float32  log pi_gen(x_t | x_<t) from the rollout engine
``prev_logprobs``        [B, S]     float32  the policy's logprobs before the update (old)
``reference_logprobs``   [B, S]     float32  the reference policy's logprobs
``rewards``              [B]        float32  scalar reward per sample
``advantages``           [B, S]     float32  per-token advantages
``on_policy``            [B]        float32  1 on rows decoded by the weights being trained
                                             (streaming, ``loss.prev_logprobs=
                                             train_forward``: the rows the loss's logprob
                                             budget figures measure; absent: all)
=======================  =========  =======  ============================================

Logprob convention: ``logprobs[b, t] = log pi(x_t | x_<t)`` and ``logprobs[:, 0] = 0``.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

Batch = Dict[str, torch.Tensor]


def batch_size(batch: Batch) -> int:
    """Rows of ``batch``. Raises ``ValueError`` if it is empty or its tensors disagree."""
    sizes = {k: v.shape[0] for k, v in batch.items()}
    if not sizes:
        raise ValueError("empty batch: no tensors")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors disagree on dimension 0: {sizes}")
    return next(iter(sizes.values()))


def select(batch: Batch, index: torch.Tensor | Sequence[int] | slice) -> Batch:
    """Rows ``index`` of every tensor (an index tensor, list or slice)."""
    if not isinstance(index, slice):
        index = torch.as_tensor(index, dtype=torch.long)
    return {k: v[index] for k, v in batch.items()}


def concat(batches: Sequence[Batch]) -> Batch:
    """Concatenate batches with the same keys along dimension 0, right-padding dimension 1
    of 2-D tensors to the longest (with 0) when their lengths differ."""
    if not batches:
        raise ValueError("concat of no batches")
    keys = batches[0].keys()
    out = {}
    for k in keys:
        parts = [b[k] for b in batches]
        if parts[0].dim() >= 2:
            width = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) if p.shape[1] < width else p
                     for p in parts]
        out[k] = torch.cat(parts, dim=0)
    return out


def shard(batch: Batch, num_shards: int) -> List[Batch]:
    """Split rows into ``num_shards`` contiguous shards (data-parallel ranks). Shard sizes
    differ by at most one row when B is not divisible; a shard may be empty."""
    n = batch_size(batch)
    bounds = [round(i * n / num_shards) for i in range(num_shards + 1)]
    return [select(batch, slice(bounds[i], bounds[i + 1])) for i in range(num_shards)]


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}
