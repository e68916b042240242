"""The residual add, RMSNorm and the linear layer after it in one kernel, for the decode step
(``generation.fused_norm_matmul``; issue 37 item 1's hand-fused kernels where the compiler does
not fuse).

Why: a decode step of a small model at a few hundred rows is set by its kernel count, not its
work (each kernel's launch and tail in a CUDA-graph replay: ~2.2 us a kernel on one H200 at
SmolLM2-135M's 351 kernels a step, bench/RESULTS.md, sixth session). The compiled decode layer
(:mod:`mcore_rl.megatron.decode_layer`) runs the residual add and RMSNorm as one Inductor kernel
and the QKV projection as a cuBLAS GEMM after it, and the pre-MLP add and RMSNorm, ``linear_fc1``
and SwiGLU as three kernels. Here each is one Triton kernel: the rows' RMSNorm is computed in
the matrix product's loop (a program sums its rows' squares while it multiplies them by the
weight, and scales the fp32 product by each row's ``1 / rms`` after the loop), and SwiGLU
in its epilogue (a program accumulates the gate's and the up projection's columns ``n`` and
``N + n`` side by side). A decode layer is then five kernels: this one for QKV, the attention
(:func:`~mcore_rl.megatron.flash_decode.flash_decode_rope`), the output projection (cuBLAS), this
one for ``linear_fc1`` with SwiGLU, ``linear_fc2`` (cuBLAS).

Numbers: the add is rounded as Megatron's (``round(x + delta)``); the product's input is
``round(h * g)`` (``g`` the norm's weight) and each row's ``1 / rms`` scales the fp32 product,
where ``torch.nn.functional.rms_norm`` rounds ``h / rms * g`` (the same in exact arithmetic);
the product accumulated in fp32 in the kernel's block order (not cuBLAS's), rounded once;
SwiGLU from the rounded products in fp32, rounded once (as the compiled layer's fused kernel). On other devices :func:`reference_norm_matmul` computes
the same with torch's ops. fp32: within 1e-5 of it (tests, Triton's interpreter).

The tile shape is chosen per shape on first use on CUDA among :data:`CONFIGS` by timing each in
a CUDA graph (``triton.testing.do_bench_cudagraph``), outside any capture; the decoder's
warm-up step, which runs before each capture with the same shapes, is that first use.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried per shape on CUDA; the first is the
# interpreter's and a capture's fallback
CONFIGS: Tuple[Tuple[int, int, int, int, int], ...] = (
    (16, 64, 64, 4, 3), (16, 64, 128, 4, 2), (32, 64, 64, 4, 3), (16, 32, 128, 4, 2),
    (32, 32, 128, 4, 2), (16, 128, 64, 4, 3), (32, 64, 128, 4, 2), (16, 64, 32, 2, 4))
_best: Dict[tuple, Tuple[int, int, int, int, int]] = {}


def _kernel():
    """The Triton kernel, imported at first use (Triton is loaded only where it runs)."""
    from mcore_rl.megatron.norm_matmul_kernel import norm_matmul_kernel

    return norm_matmul_kernel


def _check(residual, delta, norm_weight, weight, swiglu) -> int:
    """Raise ``ValueError`` naming what does not fit; return the output width."""
    if residual.dim() != 2 or residual.stride(-1) != 1:
        raise ValueError(f"norm_matmul: residual {tuple(residual.shape)} is not [M, K] with a "
                         "contiguous last dim")
    m, k = residual.shape
    if delta is not None and (delta.shape != residual.shape or delta.dtype != residual.dtype
                              or delta.stride() != residual.stride()):
        raise ValueError(f"norm_matmul: delta {tuple(delta.shape)} {delta.dtype} differs from "
                         f"residual {tuple(residual.shape)} {residual.dtype} (or its strides)")
    if norm_weight.shape != (k,):
        raise ValueError(f"norm_matmul: norm weight {tuple(norm_weight.shape)} is not [{k}]")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"norm_matmul: weight {tuple(weight.shape)} is not [N, {k}] with a "
                         "contiguous last dim")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"norm_matmul: swiglu needs an even number of weight rows (gate, then "
                         f"up), got {weight.shape[0]}")
    return weight.shape[0] // 2 if swiglu else weight.shape[0]


def reference_norm_matmul(residual: torch.Tensor, delta: Optional[torch.Tensor],
                          norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                          swiglu: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, with torch's ops (arguments and result as
    :func:`norm_matmul`): ``residual + delta``, ``F.rms_norm``, the product in fp32 rounded
    once, and SwiGLU from the rounded products in fp32."""
    hidden = residual if delta is None else residual + delta
    x = F.rms_norm(hidden, (hidden.shape[-1],), norm_weight, eps)
    out = torch.matmul(x.float(), weight.float().t()).to(weight.dtype)
    if swiglu:
        gate, up = torch.chunk(out.float(), 2, dim=-1)
        out = (F.silu(gate) * up).to(weight.dtype)
    return hidden, out


def _launch_config(key: tuple, run) -> Tuple[int, int, int, int, int]:
    """The tile shape for ``key``: the fastest of :data:`CONFIGS` timed once per key on CUDA
    (``run(config)`` launches the kernel), outside a CUDA-graph capture; the first otherwise."""
    best = _best.get(key)
    if best is not None:
        return best
    if key[0] != "cuda" or torch.cuda.is_current_stream_capturing():
        return CONFIGS[0]
    from triton.testing import do_bench_cudagraph

    times = {}
    for config in CONFIGS:
        try:
            times[config] = do_bench_cudagraph(lambda: run(config), rep=5)
        except Exception:  # a tile that does not fit (shared memory, registers): not a choice
            continue
    best = min(times, key=times.get) if times else CONFIGS[0]
    _best[key] = best
    return best


def launch(residual: torch.Tensor, delta: Optional[torch.Tensor], norm_weight: torch.Tensor,
           weight: torch.Tensor, eps: float, swiglu: bool = False,
           config: Optional[Tuple[int, int, int, int, int]] = None
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernel (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``).
    Arguments and result as :func:`norm_matmul`; ``config`` a tile shape of :data:`CONFIGS`'
    form (None: chosen per shape, module docstring)."""
    n = _check(residual, delta, norm_weight, weight, swiglu)
    m, k = residual.shape
    hidden = residual if delta is None else torch.empty_like(residual)
    out = torch.empty(m, n, dtype=weight.dtype, device=weight.device)
    precision = "ieee" if weight.dtype == torch.float32 else "tf32"
    upcast = residual.device.type != "cuda" and weight.dtype != torch.float32

    def run(tile):
        block_m, block_n, block_k, warps, stages = tile
        grid = (-(-m // block_m), -(-n // block_n))
        _kernel()[grid](residual, residual if delta is None else delta, hidden, norm_weight,
                        weight, out, m, n, k, residual.stride(0), hidden.stride(0),
                        weight.stride(0), out.stride(0), eps, HAS_DELTA=delta is not None,
                        SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        PRECISION=precision, UPCAST=upcast, num_warps=warps, num_stages=stages)

    if config is None:
        config = _launch_config((residual.device.type, m, n, k, delta is not None, swiglu,
                                 weight.dtype), run)
    run(config)
    return hidden, out


def norm_matmul(residual: torch.Tensor, delta: Optional[torch.Tensor],
                norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                swiglu: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The residual add, the RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467, eq. 4) and the
    bias-free linear layer after it, with SwiGLU (Shazeer 2020, arXiv:2002.05202, eq. 6) when
    ``swiglu``, in one kernel on CUDA (module docstring); elsewhere
    :func:`reference_norm_matmul`.

    Args:
        residual: ``[M, K]`` the residual stream (last dim contiguous), bf16/fp16/fp32.
        delta: ``[M, K]`` the sublayer output added to it first (same dtype and strides), or
            None (``residual`` is then the norm's input).
        norm_weight: ``[K]`` the RMSNorm's weight.
        weight: ``[N, K]`` the linear layer's weight (Megatron's ``[out, in]``; last dim
            contiguous), ``[2F, K]`` with ``swiglu`` (the gate's ``F`` rows, then the up
            projection's).
        eps: the RMSNorm's epsilon.
        swiglu: return ``silu(gate) * up`` ``[M, F]`` instead of the product.

    Returns:
        ``(hidden [M, K], out [M, N or F])``: ``residual + delta`` (``residual`` itself without
        a delta) and the product in ``weight``'s dtype.

    Raises:
        ValueError: shapes, dtypes or strides outside that layout (named).
    """
    if residual.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return launch(residual, delta, norm_weight, weight, eps, swiglu)
    _check(residual, delta, norm_weight, weight, swiglu)
    return reference_norm_matmul(residual, delta, norm_weight, weight, eps, swiglu)
