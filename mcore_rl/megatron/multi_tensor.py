"""Megatron-Core's multi-tensor fallbacks on torch's own multi-tensor (``foreach``) kernels.

Megatron computes the gradient norm and scales or copies lists of tensors through Apex's or
Transformer Engine's fused multi-tensor kernels (``multi_tensor_l2norm``,
``multi_tensor_scale``). Without either package it falls back to
``megatron.core.utils.local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``:

- the norm takes ``torch.norm`` of each gradient and then ``torch.tensor(list_of_norms)``,
  which reads every norm back to the host: one host-device synchronization per parameter
  tensor. On one H200, SmolLM2-135M's GSM8K step (182 parameter tensors) synchronized 182 times
  a training step there, counted by ``scripts/gpu/sync_sources`` (bench/RESULTS.md, 2026-11-28,
  fifth session);
- the scale runs ``dst.copy_(src * scale)`` per tensor: two kernels a tensor, also for the
  optimizer's copy of the fp32 main weights into the bf16 model weights (scale 1).

:func:`l2_norm` and :func:`scale` compute the same values with torch's ``foreach`` kernels (a
few launches for the whole list, no synchronization), and :func:`use_foreach_fallbacks` points
Megatron at them where, and only where, it runs its local fallbacks (with Apex or TE present
Megatron's own fused kernels stay). The workers call it before building the optimizer.
"""

from __future__ import annotations

import importlib
from typing import List, Optional, Sequence, Tuple

import torch

# Megatron's modules that bind the fallbacks at import (module attribute names below).
_NORM_MODULES = ("megatron.core.optimizer.clip_grads",)
_SCALE_MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")


def l2_norm(chunk_size: int, noop_flag: Optional[torch.Tensor],
            tensor_lists: Sequence[Sequence[torch.Tensor]], per_tensor: bool,
            *args) -> Tuple[torch.Tensor, None]:
    """The L2 norm of every tensor of ``tensor_lists`` together: a drop-in for
    ``amp_C.multi_tensor_l2norm`` as Megatron's ``get_grad_norm_fp32`` calls it through its
    multi-tensor applier (``per_tensor=False``).

    ``sqrt(sum_i ||t_i||_2^2)`` by ``torch.nn.utils.get_total_norm`` (``foreach`` kernels on CUDA,
    one norm a tensor elsewhere), without reading anything back to the host.

    Args:
        chunk_size, noop_flag: the applier's arguments, unused (as in Megatron's own fallback).
        tensor_lists: one or more lists of tensors (Megatron passes ``[grads]``: fp32 main
            gradients), any shapes, on one device.
        per_tensor: must be False (per-tensor norms are not computed, as in Megatron's fallback).

    Returns:
        ``(norm, None)``: ``norm`` ``[1]`` float32 on the tensors' device.

    Raises:
        ValueError: ``per_tensor`` True, or no tensors.
    """
    if per_tensor:
        raise ValueError("multi_tensor.l2_norm computes the norm of all tensors together "
                         "(per_tensor=False), as Megatron's fallback does")
    tensors: List[torch.Tensor] = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        raise ValueError("multi_tensor.l2_norm needs at least one tensor")
    total = torch.nn.utils.get_total_norm(tensors, norm_type=2.0)
    return total.float().reshape(1), None


def scale(chunk_size: int, noop_flag: Optional[torch.Tensor],
          tensor_lists: Sequence[Sequence[torch.Tensor]], factor: float) -> None:
    """``dst_i = src_i * factor`` for ``tensor_lists = [srcs, dsts]`` (a drop-in for
    ``amp_C.multi_tensor_scale``): in place when ``srcs`` are ``dsts`` (Megatron's gradient
    clipping), a copy with the destination's dtype otherwise (the optimizer's fp32 main weights
    into the bf16 model weights, ``factor == 1``). The same values as Megatron's fallback's
    ``dst.copy_(src * factor)``: one product in the source's dtype, one rounding into the
    destination's.

    Args:
        chunk_size, noop_flag: the applier's arguments, unused.
        tensor_lists: ``[srcs, dsts]``, two lists of equal length, pairwise of equal shape.
        factor: the scale.

    Raises:
        ValueError: not two lists of equal length.
    """
    if len(tensor_lists) != 2 or len(tensor_lists[0]) != len(tensor_lists[1]):
        raise ValueError("multi_tensor.scale takes [sources, destinations] of equal length, got "
                         f"{[len(t) for t in tensor_lists]}")
    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])
    if not srcs:
        return
    if all(s is d for s, d in zip(srcs, dsts)):
        if factor != 1.0:
            torch._foreach_mul_(dsts, factor)
        return
    torch._foreach_copy_(dsts, srcs if factor == 1.0 else torch._foreach_mul(srcs, factor))


def use_foreach_fallbacks() -> List[str]:
    """Point Megatron's multi-tensor fallbacks at :func:`l2_norm` and :func:`scale` where it
    uses ``megatron.core.utils``'s local ones (neither Apex nor Transformer Engine importable);
    leave fused kernels alone. Idempotent.

    Returns:
        ``module.attribute`` names replaced (empty when Megatron has fused kernels or this ran
        already).
    """
    from megatron.core import utils

    replaced = []
    for names, attr, local, ours in (
            (_NORM_MODULES, "l2_norm_impl", utils.local_multi_tensor_l2_norm, l2_norm),
            (_SCALE_MODULES, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, scale)):
        for name in names:
            module = importlib.import_module(name)
            if getattr(module, attr, None) is local:
                setattr(module, attr, ours)
                replaced.append(f"{name}.{attr}")
    return replaced
