"""Micro-batches for Megatron's schedules: a fixed row count, or a token budget.

A training or logprob pass cuts a worker's rows into micro-batches, one of three ways:

- **fixed** (``micro_batch_size`` rows each, in row order): every micro-batch has the same
  ``[rows, width]`` shape, width = the longest row of the whole batch. This is what the
  pipeline schedules (PP > 1) assume by default: they allocate the receive buffer of every
  micro-batch from one ``(seq_length, micro_batch_size, hidden)`` shape.
- **token budget** (``max_tokens_per_microbatch``): rows sorted by length, longest first, and
  cut greedily so that ``rows x width`` of each micro-batch (its padded token count, the
  figure that bounds activation memory) stays within the budget; each micro-batch is trimmed
  to its own longest row. Similar lengths share a micro-batch, so little compute goes to
  padding (the "sort and bucket by length" dynamic batching of verl's ``rearrange_micro_batches``
  and NeMo RL's ``dynamic_batching``). Shapes differ between micro-batches: the no-pipelining
  schedule (PP = 1) takes any shape from the data iterator; with PP > 1 the caller sets
  Megatron's ``config.variable_seq_lengths`` so the schedule sends each shape before the
  activations (:func:`shapes_vary` tells when).
- **token budget, uniform shapes** (``uniform_shapes=True``): for the interleaved schedule
  (virtual pipeline stages). It sends shapes forward and backward in one call, and Megatron's
  shape exchange (``_communicate_shapes``, megatron-core 0.16.1) always batches its p2p ops:
  with PP=2 both directions go to one peer and are matched in posting order, so shapes are
  swapped (measured: a deadlock on gloo). Fixed micro-batches of ``budget // width`` rows at
  the batch's width instead, so the budget still bounds each micro-batch.

The loss is a sum over tokens divided by the global count (``docs/design.md``, "Normalization"), so
both ways give the same gradient up to float summation order.

Each micro-batch carries ``row_index`` ``[b]`` int64: the row's index in the input batch, -1
for padding rows. :func:`gather_rows` puts per-row results back in input order.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from mcore_rl.data.batch import Batch, batch_size, select

ROW_INDEX = "row_index"


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def token_budget_groups(lengths: Sequence[int] | torch.Tensor, max_tokens: int,
                        width_multiple: int = 1) -> List[List[int]]:
    """Row indices of each micro-batch under a token budget.

    Rows are taken longest first (ties in index order) and a micro-batch is closed when one
    more row would make ``rows x width`` exceed ``max_tokens``, where ``width`` is the
    micro-batch's longest row rounded up to ``width_multiple`` (the padded width it will run
    at, e.g. a multiple of TP under sequence parallelism).

    Args:
        lengths: ``[B]`` valid tokens per row (``input_lengths``).
        max_tokens: the budget of padded tokens per micro-batch
            (config ``policy.max_tokens_per_microbatch``).
        width_multiple: micro-batch widths are rounded up to a multiple of it.

    Returns:
        index lists, longest rows first; each row appears exactly once.

    Raises:
        ValueError: ``max_tokens`` or ``width_multiple`` below 1, or a row whose padded length
            alone exceeds the budget (named with its index and length).
    """
    if max_tokens < 1 or width_multiple < 1:
        raise ValueError(f"policy.max_tokens_per_microbatch ({max_tokens}) and width_multiple "
                         f"({width_multiple}) must be >= 1")
    lengths = [int(x) for x in (lengths.tolist() if torch.is_tensor(lengths) else lengths)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: List[List[int]] = []
    width = 0
    for i in order:
        w = _round_up(max(lengths[i], 1), width_multiple)
        if w > max_tokens:
            raise ValueError(f"row {i} has {lengths[i]} tokens (padded to {w}), more than "
                             f"policy.max_tokens_per_microbatch ({max_tokens}): a micro-batch "
                             f"holds at least one whole row")
        if groups and (len(groups[-1]) + 1) * width <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = w  # rows come longest first: the first row sets the width
    return groups


def _padding_rows(batch: Batch, rows: int, width: int) -> Batch:
    """``rows`` all-zero rows of ``width`` columns that no loss counts: ``token_mask`` and
    ``sample_mask`` are 0, ``input_lengths`` 1, ``row_index`` -1."""
    out = {}
    for k, v in batch.items():
        shape = (rows, width, *v.shape[2:]) if v.dim() >= 2 else (rows, *v.shape[1:])
        out[k] = torch.zeros(shape, dtype=v.dtype, device=v.device)
    out["input_lengths"].fill_(1)
    out[ROW_INDEX] = torch.full((rows,), -1, dtype=torch.long)
    return out


def _with_width(mb: Batch, width: int) -> Batch:
    """Cut or right-pad (with 0) dimension 1 of the 2-D tensors to ``width``."""
    out = {}
    for k, v in mb.items():
        if v.dim() >= 2:
            v = v[:, :width]
            if v.shape[1] < width:
                v = torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]))
        out[k] = v
    return out


def make_microbatches(batch: Batch, micro_batch_size: int,
                      max_tokens_per_microbatch: Optional[int] = None,
                      width_multiple: int = 1, count_multiple: int = 1,
                      uniform_shapes: bool = False) -> List[Batch]:
    """Cut ``batch`` into the micro-batches of one schedule call.

    Args:
        batch: right-padded rows with ``input_ids [B, S]`` and ``input_lengths [B]`` (any other
            ``[B, ...]`` tensors are cut along).
        micro_batch_size: rows per micro-batch (fixed mode; ignored with a budget).
        max_tokens_per_microbatch: None for fixed micro-batches, else the token budget
            (:func:`token_budget_groups`).
        width_multiple: every micro-batch's width is a multiple of it (TP under sequence
            parallelism: Megatron splits the sequence evenly over the TP ranks).
        count_multiple: the number of micro-batches is a multiple of it (PP for the
            interleaved schedule, which runs micro-batches in groups of PP).
        uniform_shapes: every micro-batch gets one shape (the interleaved schedule needs it):
            in fixed mode the last micro-batch is padded to ``micro_batch_size`` rows with
            masked rows; with a budget, fixed micro-batches of ``max(1, budget // W)`` rows (W
            as in fixed mode).

    Returns:
        micro-batches with ``row_index`` added. Fixed: ``[micro_batch_size, W]``, W = the
        longest row rounded up to ``width_multiple``, rows in order; the last holds the rows
        left (padded with masked rows only with ``uniform_shapes``: padding rows would cost as
        much as real ones, e.g. 4x for 64 rows at a 256-row logprob micro-batch). Budget: each at its own width, longest rows first. Micro-batches of
        padding rows only are appended to reach ``count_multiple`` (one row each with a
        budget, ``micro_batch_size`` rows in fixed mode).

    Raises:
        ValueError: an empty batch, ``micro_batch_size`` below 1 in fixed mode, or a budget
            error of :func:`token_budget_groups`.
    """
    n = batch_size(batch)
    lengths = batch["input_lengths"]
    batch = dict(batch, **{ROW_INDEX: torch.arange(n)})
    if max_tokens_per_microbatch is not None and uniform_shapes:
        token_budget_groups(lengths, max_tokens_per_microbatch, width_multiple)  # rows fit
        width = _round_up(int(lengths.max()), width_multiple)
        micro_batch_size, max_tokens_per_microbatch = max_tokens_per_microbatch // width, None
    if max_tokens_per_microbatch is None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        width = _round_up(int(lengths.max()), width_multiple)
        groups = [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]
        rows = micro_batch_size
    else:
        groups = token_budget_groups(lengths, max_tokens_per_microbatch, width_multiple)
        rows = 1
    out = []
    for g in groups:
        mb = select(batch, g)
        w = width if max_tokens_per_microbatch is None else \
            _round_up(int(mb["input_lengths"].max()), width_multiple)
        mb = _with_width(mb, w)
        if len(g) < rows and uniform_shapes:
            pad = _padding_rows(mb, rows - len(g), w)
            mb = {k: torch.cat([v, pad[k]]) for k, v in mb.items()}
        out.append(mb)
    pad_width = out[-1]["input_ids"].shape[1]
    while len(out) % count_multiple:
        out.append(_padding_rows(out[-1], rows, pad_width))
    return out


def shapes_vary(microbatches: Sequence[Batch]) -> bool:
    """True when the micro-batches' ``input_ids`` shapes differ (a pipeline schedule must then
    run with Megatron's ``config.variable_seq_lengths``)."""
    return len({tuple(mb["input_ids"].shape) for mb in microbatches}) > 1


def gather_rows(parts: Sequence[torch.Tensor], row_indices: Sequence[torch.Tensor],
                num_rows: int, width: int) -> torch.Tensor:
    """Per-row results of micro-batches back in input row order.

    Args:
        parts: ``[b_i, s_i, ...]`` per micro-batch (any widths).
        row_indices: the micro-batches' ``row_index`` ``[b_i]`` (-1 rows are dropped).
        num_rows: B of the input batch; every row must appear once.
        width: columns of the result: each part is cut or zero-padded to it.

    Returns:
        ``[num_rows, width, ...]`` with the parts' dtype and device.

    Raises:
        ValueError: a row of ``0 .. num_rows-1`` is missing or appears twice.
    """
    index = torch.cat([r.to(parts[0].device) for r in row_indices])
    values = torch.cat([_with_width({"x": p}, width)["x"] for p in parts])
    keep = index >= 0
    index, values = index[keep], values[keep]
    if index.numel() != num_rows or not torch.equal(index.sort().values,
                                                     torch.arange(num_rows, device=index.device)):
        raise ValueError(f"micro-batch rows {index.tolist()} are not a permutation of "
                         f"0..{num_rows - 1}")
    out = values.new_zeros((num_rows, *values.shape[1:]))
    out[index] = values
    return out
