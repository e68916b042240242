"""Context parallelism (CP) without Transformer Engine: the sequence split, the gathers and the
attention of the ``torch`` layer spec, for padded and for packed (THD) micro-batches.

Layout (Megatron-Core's load-balanced CP chunking, the one its RoPE slicing assumes:
``rope_utils.get_pos_emb_on_this_cp_rank`` and Megatron-LM's ``get_batch_on_this_cp_rank``):
a micro-batch of width ``S`` (a multiple of ``2 CP``) is cut into ``2 CP`` chunks of ``c = S /
(2 CP)`` positions, and CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r``, in that order
(``2 c`` positions). Under causal attention the early chunks see few keys and the late chunks
many; pairing chunk ``r`` with chunk ``2 CP - 1 - r`` gives every rank the same work. A packed
micro-batch (``cu_seqlens``: :mod:`mcore_rl.data.packing`, every sequence padded to a multiple of
``2 CP``) is chunked the same way sequence by sequence, rank ``r`` holding chunks ``r`` and ``2 CP
- 1 - r`` of every sequence, sequences in order: Transformer Engine's THD layout
(``thd_get_partitioned_indices``, which Megatron-Core's ``get_thd_batch_on_this_cp_rank`` calls;
a CUDA kernel of TE, hence computed here) and the one Megatron's THD RoPE slices its frequencies
for (``rope_utils._get_thd_freqs_on_this_cp_rank``). A padded micro-batch is the packed one of a
single sequence (``cu_seqlens = [0, S]``).

- :func:`local_positions` / :func:`split`: a rank's positions and its slice of a tensor.
- :func:`gather`: the full width back from every rank's slice (all-gather); its backward keeps
  the rank's own slice of the gradient (every CP rank computes the same function of the full
  tensor, the loss, so each passes back only what its own slice contributed).
- :func:`gather_keys_values`: all-gather of keys/values whose backward reduce-scatters
  (sums) the gradients: the ``all_gather`` method of Transformer Engine's CP attention
  (``cp_comm_type=all_gather``); :func:`gather_sequence` puts them in global order.
- :func:`attention`: a rank's two query chunks attend to the gathered keys, each chunk
  causally up to its own global positions (padded micro-batches; packed ones attend within each
  sequence: :class:`mcore_rl.megatron.attention.TorchSDPAttention`).

Gradients: every CP rank back-propagates the whole loss through its own tokens only, so the
sum over CP ranks of the parameter gradients is the full gradient; Megatron's DDP sums over the
DP x CP group (``get_data_parallel_group(with_context_parallel=True)``), and the loss count
must be counted once per CP group (the workers hand Megatron the count on CP rank 0 only).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

_order_cache: dict = {}  # the last two entries: (cu_seqlens, width, cp_size, device) -> order


def _order(width: int, cp_size: int, device, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Every rank's positions in a packed row, rank after rank (``[CP, width / CP]`` int64 on
    ``device``): row ``r`` is :func:`local_positions` of rank ``r``. Position ``t`` of sequence
    ``j`` (start ``s_j``, ``L_j`` tokens, a multiple of ``2 CP``) is in chunk ``k = (t - s_j) //
    (L_j / 2 CP)``, held by rank ``k`` for ``k < CP`` and ``2 CP - 1 - k`` otherwise; a rank's
    positions in ascending order are its chunks of each sequence, sequences in order.

    Computed where ``cu_seqlens`` lives, cached for the last two ``cu_seqlens`` objects: a
    micro-batch's host copy (the worker's split and gathers) and, on the ``transformer_engine``
    spec, its device copy (``PackedSeqParams``, read by the THD RoPE), each shared by every layer
    of a forward and its backward. A host ``cu_seqlens`` is checked (lengths multiples of ``2
    CP``, summing to ``width``: ``ValueError``); a device one is not (a check would sync the
    stream; the worker splits the ids with the host copy of the same lengths first)."""
    key = (cu_seqlens, width, cp_size, torch.device(device))
    for hit in _order_cache.get("entries", ()):
        if hit[0][0] is key[0] and hit[0][1:] == key[1:]:
            return hit[1]
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    if cu.device.type == "cpu" and (int(cu[-1]) != width or bool((lengths % (2 * cp_size)).any())):
        raise ValueError(f"packed sequences {lengths.tolist()} (of {width} tokens) are not "
                         f"each a multiple of 2 x context_parallel_size ({2 * cp_size})")
    idx = torch.arange(width, device=cu.device)
    doc = torch.searchsorted(cu[1:], idx, right=True).clamp_(max=cu.numel() - 2)
    chunk = (idx - cu[doc]) * (2 * cp_size) // (cu[doc + 1] - cu[doc])
    owner = torch.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk)
    order = torch.argsort(owner, stable=True).view(cp_size, -1).to(device)
    _order_cache["entries"] = [(key, order)] + _order_cache.get("entries", [])[:1]
    return order


def local_positions(width: int, cp_size: int, cp_rank: int,
                    device: torch.device | str = "cpu",
                    cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Global positions held by CP rank ``cp_rank``: chunks ``cp_rank`` and ``2 cp_size - 1 -
    cp_rank`` of ``2 cp_size`` equal chunks of ``0 .. width - 1`` (Megatron-Core's
    load-balanced CP layout), or of every sequence of a packed row.

    Args:
        width: positions of the micro-batch (the packed row's tokens).
        cu_seqlens: None for one sequence of ``width``; else ``[n + 1]`` int, the starts of
            the packed row's sequences (``cu_seqlens[-1] = width``), each sequence's length a
            multiple of ``2 cp_size`` (read on the host).

    Returns:
        int64 ``[width / cp_size]`` on ``device``, ascending.

    Raises:
        ValueError: ``width`` or a sequence not a multiple of ``2 cp_size``, or ``cp_rank``
            outside ``[0, cp_size)``.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} outside [0, {cp_size})")
    if width % (2 * cp_size):
        raise ValueError(f"width {width} is not a multiple of 2 x context_parallel_size "
                         f"({2 * cp_size})")
    if cu_seqlens is None:
        c = width // (2 * cp_size)
        base = torch.arange(c, device=device)
        return torch.cat((base + cp_rank * c, base + (2 * cp_size - 1 - cp_rank) * c))
    return _order(width, cp_size, device, cu_seqlens)[cp_rank]


def split(tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int,
          cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This CP rank's slice of ``tensor`` along ``dim`` (width a multiple of ``2 cp_size``; with
    ``cu_seqlens``, a packed row whose sequences each are): its chunks concatenated
    (:func:`local_positions`). Same dtype; a copy."""
    if cp_size == 1:
        return tensor
    index = local_positions(tensor.shape[dim], cp_size, cp_rank, tensor.device, cu_seqlens)
    return tensor.index_select(dim, index)


def _all_gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The ranks' tensors concatenated along ``dim`` in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _unshuffle(concat: torch.Tensor, dim: int, cp_size: int,
               cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rank-ordered concatenation of every rank's slice -> global order along ``dim`` (of a
    packed row with ``cu_seqlens``)."""
    if cu_seqlens is not None:
        order = _order(concat.shape[dim], cp_size, concat.device, cu_seqlens).flatten()
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return concat.index_select(dim, inverse)
    chunks = concat.chunk(2 * cp_size, dim=dim)  # rank r's: 2 r (chunk r), 2 r + 1 (2 CP - 1 - r)
    by_global = [chunks[2 * j] if j < cp_size else chunks[2 * (2 * cp_size - 1 - j) + 1]
                 for j in range(2 * cp_size)]
    return torch.cat(by_global, dim=dim)


class _GatherKeepLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group, cp_size, cp_rank, cu_seqlens):
        ctx.args = (dim, cp_size, cp_rank, cu_seqlens)
        return _unshuffle(_all_gather(tensor, dim, group), dim, cp_size, cu_seqlens)

    @staticmethod
    def backward(ctx, grad):
        dim, cp_size, cp_rank, cu_seqlens = ctx.args
        return split(grad, dim, cp_size, cp_rank, cu_seqlens), None, None, None, None, None


def gather(tensor: torch.Tensor, dim: int = 1, group=None,
           cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The full width of a per-position tensor from every CP rank's slice.

    Args:
        tensor: this rank's slice (:func:`split`) along ``dim``, ``2 c`` positions; any dtype,
            the same shape on every rank of ``group``.
        dim: the sequence dimension.
        group: the CP group (default: Megatron's ``get_context_parallel_group()``).
        cu_seqlens: the sequence starts of a packed row (:func:`local_positions`), or None.

    Returns:
        ``tensor``'s shape with ``2 c CP`` positions along ``dim``, in global order, the same on
        every rank. Differentiable: the backward returns this rank's slice of the gradient
        only (no reduction), right when every CP rank computes the same function of the
        result (the loss on the full width). Collective over ``group``.
    """
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    cp_size = dist.get_world_size(group)
    if cp_size == 1:
        return tensor
    return _GatherKeepLocal.apply(tensor, dim, group, cp_size, dist.get_rank(group), cu_seqlens)


class _GatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _all_gather(tensor, 0, group)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad.chunk(size, dim=0)[rank].clone(), None


def gather_keys_values(tensor: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 (rank order, not global order) whose backward reduce-scatters:
    each rank gets the sum over ranks of the gradients of its own slice (a key is attended by
    the queries of every rank). ``[s, ...]`` -> ``[CP s, ...]``; collective over ``group``."""
    return _GatherReduceScatter.apply(tensor, group)


def gather_sequence(tensor: torch.Tensor, group,
                    cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`gather_keys_values` in global order: this rank's slice ``[s, ...]`` (dim 0) ->
    every position ``[CP s, ...]`` (of a packed row with ``cu_seqlens``); collective."""
    return _unshuffle(gather_keys_values(tensor, group), 0, dist.get_world_size(group), cu_seqlens)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
              group, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's query chunks over the whole sequence's keys: the
    all-gather method of Transformer Engine's CP attention (``cp_comm_type=all_gather``).

    Keys and values are all-gathered over ``group`` (:func:`gather_keys_values`); query chunk
    ``j`` (global chunk index; ``j = r`` and ``j = 2 CP - 1 - r`` on rank ``r``) attends to
    the keys of positions ``< (j + 1) c`` with the causal mask aligned at the bottom right
    (``causal_lower_right(c, (j + 1) c)``: query ``i`` of the chunk is position ``j c + i``),
    one SDPA call per chunk. Grouped-query attention: SDPA's ``enable_gqa`` for the first chunk
    (plain ``is_causal``); the KV heads repeated for the others (torch's lower-right causal
    path may take the memory-efficient kernel, which has no GQA).

    Args:
        query: ``[b, np, 2 c, hn]``; key, value: ``[b, ng, 2 c, hn]`` (this rank's two chunks,
            :func:`split`, ``np % ng == 0``).
        scale: softmax scale.
        group: the CP group.
        dropout_p: attention dropout (training).

    Returns:
        ``[b, np, 2 c, hn]`` in ``query``'s dtype.
    """
    cp_size, rank = dist.get_world_size(group), dist.get_rank(group)
    c = query.shape[2] // 2
    # [b, ng, 2c, hn] -> [2c, b, ng, hn] for the dim-0 gather, back after
    k_all, v_all = (gather_sequence(t.permute(2, 0, 1, 3), group).permute(1, 2, 0, 3)
                    for t in (key, value))
    groups = query.shape[1] // key.shape[1]
    outs = []
    for half, j in enumerate((rank, 2 * cp_size - 1 - rank)):
        q = query[:, :, half * c:(half + 1) * c]
        span = (j + 1) * c
        k, v = k_all[:, :, :span], v_all[:, :, :span]
        if span == c:  # chunk 0: keys of its own positions only
            outs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale,
                                                       is_causal=True, enable_gqa=groups > 1))
            continue
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        outs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale,
                                                   attn_mask=causal_lower_right(c, span)))
    return torch.cat(outs, dim=2)
