"""Sequence packing (THD): micro-batches of concatenated sequences instead of padded rows.

A packed micro-batch is one row ``input_ids [1, T]``: its sequences back to back (each at
positions ``0 .. l_i - 1``), then zeros up to a multiple of ``width_multiple`` (TP under
sequence parallelism). ``cu_seqlens [n + 1]`` (int32) marks where each sequence starts, as in
Megatron-Core's ``PackedSeqParams(qkv_format='thd')``, which GPTModel passes to attention and
to RoPE (``_apply_rotary_pos_emb_thd``: positions restart at every sequence). Attention stays
within a sequence (:func:`mcore_rl.megatron.attention.varlen_causal_attention`).

Micro-batches under a token budget (:func:`packed_groups`): first-fit decreasing bin packing
of the rows by length into bins of at most ``max_tokens`` tokens (the dynamic batching of
verl's ``rearrange_micro_batches`` and NeMo RL's sequence packing); the bin count can be
raised to a given minimum (equal counts on every DP rank: Megatron's schedules run the same
number of micro-batches on every rank, and the DP gradient all-reduce is collective).

Per-sequence shifts: next-token targets and logprobs never cross a sequence boundary
(:func:`packed_targets`); the first token of every sequence gets logprob 0 / value 0 after
:func:`unpack`, as in the padded layout.

Context parallelism (CP > 1): every sequence is padded to a multiple of ``2 CP``
(``sequence_multiple``), its padding right after its tokens and counted as part of it in
``cu_seqlens`` (Transformer Engine's ``cu_seqlens_padded``; causal attention never lets a valid
token see the padding after it), so each CP rank can hold two chunks of every sequence
(:mod:`mcore_rl.megatron.context_parallel`); :func:`unpack` keeps each sequence's valid tokens
(``lengths``).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from mcore_rl.data.batch import Batch, select
from mcore_rl.data.microbatching import ROW_INDEX, _padding_rows, _with_width


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def packed_groups(lengths: Sequence[int] | torch.Tensor, max_tokens: int,
                  min_groups: int = 1) -> List[List[int]]:
    """Row indices of each packed micro-batch: first-fit decreasing under a token budget.

    Rows are taken longest first (ties by index); each goes into the first bin whose tokens
    plus its length stay within ``max_tokens``, else a new bin. If fewer than ``min_groups``
    bins result, the largest bins are split (their rows dealt out to new bins) until there are
    ``min_groups`` bins or every bin holds one row.

    Args:
        lengths: ``[B]`` valid tokens per row.
        max_tokens: the token budget of a packed micro-batch (config
            ``policy.max_tokens_per_microbatch``).
        min_groups: at least this many bins (the largest bin count over DP ranks).

    Returns:
        index lists; each row appears exactly once; at most ``max(min_groups, B)`` lists.

    Raises:
        ValueError: ``max_tokens`` below 1, or a row longer than ``max_tokens`` (named).
    """
    if max_tokens < 1:
        raise ValueError(f"policy.max_tokens_per_microbatch must be >= 1, got {max_tokens}")
    lengths = [int(x) for x in (lengths.tolist() if torch.is_tensor(lengths) else lengths)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: List[List[int]] = []
    used: List[int] = []
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(f"row {i} has {lengths[i]} tokens, more than "
                             f"policy.max_tokens_per_microbatch ({max_tokens}): a packed "
                             f"micro-batch holds at least one whole sequence")
        for b, u in enumerate(used):
            if u + lengths[i] <= max_tokens:
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    while len(bins) < min_groups and any(len(b) > 1 for b in bins):
        big = max(range(len(bins)), key=lambda b: (len(bins[b]) > 1, used[b]))
        rows = bins.pop(big)
        used.pop(big)
        half = [rows[0::2], rows[1::2]]
        for h in half:
            bins.append(h)
            used.append(sum(lengths[i] for i in h))
    return bins


def pack(batch: Batch, rows: Sequence[int], width_multiple: int = 1,
         sequence_multiple: int = 1) -> Batch:
    """Concatenate the valid tokens of ``rows`` of a right-padded batch into one packed row.

    Args:
        batch: ``input_ids [B, S]``, ``input_lengths [B]`` and any other ``[B, S, ...]``
            per-token tensors (cut and concatenated the same way) or ``[B]`` per-row tensors
            (kept as ``[n]``, in ``rows`` order).
        rows: the rows to pack, in order.
        width_multiple: the packed length is rounded up to it with zero tokens.
        sequence_multiple: each sequence is padded to a multiple of it with zero tokens right
            after its own (context parallelism: ``2 CP``); the packed length is then rounded
            up to a multiple of both.

    Returns:
        a micro-batch: per-token tensors ``[1, T]`` (padding zeros), per-row tensors ``[n]``,
        plus ``cu_seqlens`` int32, ``[n + 1]``, or ``[n + 2]`` when a padding tail exists (the
        tail is one more sequence: Megatron's THD RoPE splits the whole tensor by it), each
        sequence with its own padding, and ``position_ids [1, T]`` int64 (restart at 0 in
        every sequence and count on through its padding; the padding tail counts from 0 too).
    """
    lengths = batch["input_lengths"]
    S = batch["input_ids"].shape[1]
    lens = [int(lengths[r]) for r in rows]
    spans = [_round_up(l, sequence_multiple) for l in lens]
    total = sum(spans)
    T = _round_up(max(total, 1), math.lcm(width_multiple, sequence_multiple))
    out: Batch = {}
    for k, v in batch.items():
        if v.dim() >= 2 and v.shape[1] == S:
            parts = []
            for r, l, p in zip(rows, lens, spans):
                parts += [v[r, :l]] + ([v.new_zeros((p - l, *v.shape[2:]))] if p > l else [])
            pad = v.new_zeros((T - total, *v.shape[2:]))
            out[k] = torch.cat(parts + [pad])[None]
        else:
            out[k] = v[list(rows)]
    seqs = spans + ([T - total] if T > total else [])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seqs, dtype=torch.int32).cumsum(0)
    out["cu_seqlens"] = cu
    out["position_ids"] = torch.cat([torch.arange(l) for l in seqs])[None]
    return out


def packed_targets(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Next-token targets of a packed row: ``targets[t] = input_ids[t + 1]`` inside a sequence;
    the last token of each sequence (and the tail) gets target 0 (its logprob is never read).

    Args:
        input_ids: ``[1, T]`` int64. cu_seqlens: ``[n + 1]`` int.

    Returns:
        ``[1, T]`` int64.
    """
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    ends = cu_seqlens[1:].to(device=input_ids.device, dtype=torch.long) - 1
    targets[:, ends] = 0
    return targets


def unpack(values: torch.Tensor, cu_seqlens: torch.Tensor, width: int, shift: int = 0,
           num_rows: int | None = None, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token values of a packed row back to right-padded rows.

    Args:
        values: ``[1, T, ...]`` or ``[T, ...]`` (token ``t`` of the packed row).
        cu_seqlens: ``[n + 1]`` int.
        width: columns of the result (``>=`` the longest sequence).
        shift: 1 to move each sequence's values one position right within the sequence
            (``out[i, j] = values[start_i + j - 1]`` for ``j >= 1``, ``out[i, 0] = 0``): the
            logprob of token ``j`` is computed at position ``j - 1``; 0 to keep positions.
        num_rows: sequences to return (the first ``num_rows`` of ``cu_seqlens``; default all:
            pass the row count to drop a padding tail).
        lengths: ``[>= num_rows]`` the valid tokens of each sequence (``<= width``), when its
            span in ``cu_seqlens`` also holds padding (``pack``'s ``sequence_multiple``);
            default: the whole span.

    Returns:
        ``[num_rows, width, ...]`` with zeros past each sequence (and at position 0 when shifted).
    """
    if values.dim() >= 2 and values.shape[0] == 1 and values.dim() > 1:
        values = values[0]
    n = cu_seqlens.numel() - 1 if num_rows is None else num_rows
    # One scatter for all sequences (no host sync, a constant number of kernels): token t of
    # sequence j goes to column t - start_j + shift; a token shifted past its sequence's end
    # goes to a spare column `width`, dropped at the end.
    cu = cu_seqlens[:n + 1].to(device=values.device, dtype=torch.long)
    idx = torch.arange(values.shape[0], device=values.device)
    doc = torch.searchsorted(cu[1:], idx, right=True).clamp_(max=max(n - 1, 0))
    col = idx - cu[doc] + shift
    valid = cu[1:] - cu[:-1] if lengths is None else \
        lengths[:n].to(device=values.device, dtype=torch.long)
    col = torch.where((col < valid[doc]) & (idx < cu[-1]), col, width) if n else col
    out = values.new_zeros((n, width + 1, *values.shape[1:]))
    if n:
        out[doc, col] = values
    return out[:, :width]


def padding_fraction(computed_tokens: int, valid_tokens: int) -> float:
    """``(computed - valid) / computed``: the share of a pass's token positions that were
    padding (0.0 for an empty pass)."""
    return (computed_tokens - valid_tokens) / computed_tokens if computed_tokens else 0.0


PACKED_IDS = "packed_input_ids"
PACKED_POSITIONS = "packed_position_ids"
CU_SEQLENS = "cu_seqlens"
MAX_SEQLEN = "max_seqlen"  # a 0-d CPU tensor: stays on the host


def make_packed_microbatches(batch: Batch, max_tokens: int, width_multiple: int = 1,
                             min_count: int = 1, sequence_multiple: int = 1) -> List[Batch]:
    """Cut ``batch`` into packed micro-batches (:func:`packed_groups`), each carrying both
    layouts: the model runs on the packed row, the loss reads the usual right-padded rows.

    Args:
        batch: right-padded rows (``input_ids [B, S]``, ``input_lengths [B]``, any other
            ``[B, ...]`` tensors).
        max_tokens: token budget of one packed micro-batch (before rounding to
            ``width_multiple``), each row counted with its padding to ``sequence_multiple``.
        width_multiple: packed lengths are rounded up to it (TP under sequence parallelism).
        min_count: at least this many micro-batches (the largest count over DP ranks); when
            the rows cannot be split further, micro-batches of one masked padding row are added.
        sequence_multiple: every sequence padded to a multiple of it (:func:`pack`; context
            parallelism: ``2 CP``).

    Returns:
        micro-batches with the padded rows of the group (each cut to its own longest row,
        ``row_index`` added: -1 for padding rows) plus ``packed_input_ids [1, T]``,
        ``packed_position_ids [1, T]``, ``cu_seqlens`` (:func:`pack`; T a multiple of
        ``width_multiple`` and ``sequence_multiple``) and ``max_seqlen`` (0-d, its longest
        sequence with its padding, kept on the host).

    Raises:
        ValueError: as :func:`packed_groups`.
    """
    lengths = batch["input_lengths"]
    n = lengths.numel()
    batch = dict(batch, **{ROW_INDEX: torch.arange(n)})
    spans = [_round_up(int(x), sequence_multiple) for x in lengths.tolist()]
    out = []
    for g in packed_groups(spans, max_tokens, min_groups=min_count):
        mb = select(batch, g)
        mb = _with_width(mb, int(mb["input_lengths"].max()))
        packed = pack({"input_ids": mb["input_ids"], "input_lengths": mb["input_lengths"]},
                      range(len(g)), width_multiple, sequence_multiple)
        mb[PACKED_IDS], mb[PACKED_POSITIONS] = packed["input_ids"], packed["position_ids"]
        mb[CU_SEQLENS] = packed["cu_seqlens"]
        mb[MAX_SEQLEN] = (packed["cu_seqlens"][1:] - packed["cu_seqlens"][:-1]).max()
        out.append(mb)
    width = math.lcm(width_multiple, sequence_multiple)
    while len(out) < min_count:
        mb = _padding_rows({k: v for k, v in batch.items() if k != ROW_INDEX}, 1, 1)
        mb[PACKED_IDS] = torch.zeros(1, width, dtype=torch.long)
        mb[PACKED_POSITIONS] = torch.arange(width)[None]
        mb[CU_SEQLENS] = torch.tensor([0, width], dtype=torch.int32)
        mb[MAX_SEQLEN] = torch.tensor(width)
        out.append(mb)
    return out


def computed_tokens(mb: Batch) -> int:
    """Token positions the model computes for micro-batch ``mb``: the packed length, else
    rows x width."""
    return int(mb[PACKED_IDS].numel()) if PACKED_IDS in mb else int(mb["input_ids"].numel())
