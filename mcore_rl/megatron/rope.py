"""Rotary embeddings of packed (THD) micro-batches in one pass instead of one per sequence.

Megatron-Core's unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``, used when
``apply_rope_fusion`` is off, i.e. without Transformer Engine) reads the sequence lengths to
the host (``cu_seqlens.tolist()``: a device sync) and applies the rotation sequence by sequence
(0.19) or slices the frequencies sequence by sequence (0.16): with 256 sequences a packed
micro-batch, 2 x 256 small launches per attention layer and a sync each, which made packed
training 12x slower than padded on one H100 (bench/RESULTS.md, "Sequence packing on the GPU").

:func:`packed_rope` computes the same thing with no host sync and a constant number of
kernels: the position of every packed token within its sequence,
``pos[i] = i - cu_seqlens[doc(i)]`` (``doc(i)``: the sequence holding token ``i``, by
``searchsorted``), gathers ``freqs[pos]`` once per micro-batch (cached on the ``cu_seqlens``
tensor object, which every layer of a forward shares) and rotates the whole ``[t, h, d]``
tensor with Megatron's own BSHD function: the formula of Su et al. 2021 ("RoFormer", eq. 34),
as Megatron applies it to each sequence from position 0. :func:`install` puts it in Megatron's
place for context-parallel size 1 and per-sequence frequencies (Megatron's "CASE 2"); every
other case (CP > 1, frequencies of the whole packed batch) goes to Megatron's function.
"""

from __future__ import annotations

import torch

_cache: dict = {}  # one entry: (cu_seqlens, freqs, total tokens) -> packed freqs


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each packed token within its sequence.

    Args:
        cu_seqlens: ``[n + 1]`` int, cumulative sequence lengths (``cu_seqlens[0] = 0``,
            ``cu_seqlens[-1] = total``), on any device.
        total: number of packed tokens.

    Returns:
        int64 ``[total]`` on ``cu_seqlens``'s device: ``i - cu_seqlens[j]`` for token ``i`` of
        sequence ``j``.
    """
    idx = torch.arange(total, device=cu_seqlens.device)
    starts = cu_seqlens.to(torch.int64)
    doc = torch.searchsorted(starts[1:], idx, right=True).clamp_(max=starts.numel() - 2)
    return idx - starts[doc]


def packed_rope(original, t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                *args, cp_group=None, **kwargs) -> torch.Tensor:
    """RoPE of a packed ``[t, h, d]`` tensor, each sequence rotated from position 0.

    Args:
        original: Megatron's ``_apply_rotary_pos_emb_thd`` (called for CP > 1 and for
            frequencies that cover the whole packed batch).
        t: ``[T, h, d]`` packed queries or keys; ``cu_seqlens``: ``[n + 1]`` with
            ``cu_seqlens[-1] = T``; ``freqs``: ``[max_s, 1, 1, d_rot]`` (max_s >= the longest
            sequence). Other arguments as Megatron's.

    Returns:
        ``[T, h, d]`` in ``t``'s dtype, equal to Megatron's result.
    """
    from megatron.core.models.common.embeddings import rope_utils

    total = t.shape[0]
    if (cp_group is not None and cp_group.size() > 1) or freqs.shape[0] == total:
        return original(t, cu_seqlens, freqs, *args, cp_group=cp_group, **kwargs)
    key = (cu_seqlens, freqs, total)
    hit = _cache.get("entry")
    if hit is None or any(a is not b for a, b in zip(hit[0][:2], key[:2])) or hit[0][2] != total:
        pos = packed_positions(cu_seqlens.to(freqs.device, non_blocking=True), total)
        hit = (key, freqs[pos])
        _cache["entry"] = hit
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), hit[1], *args, **kwargs).squeeze(1)


def install() -> None:
    """Put :func:`packed_rope` in Megatron-Core's place (idempotent; the worker calls it before
    a packed forward)."""
    import functools

    from megatron.core.models.common.embeddings import rope_utils

    current = rope_utils._apply_rotary_pos_emb_thd
    if getattr(current, "_mcore_rl_packed", False):
        return
    patched = functools.partial(packed_rope, current)
    patched._mcore_rl_packed = True
    rope_utils._apply_rotary_pos_emb_thd = patched
