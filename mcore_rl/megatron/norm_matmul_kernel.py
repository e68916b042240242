"""The Triton kernel of :func:`mcore_rl.megatron.norm_matmul.norm_matmul` (imported by it at
first use; ``TRITON_INTERPRET=1`` before this import runs it on CPU tensors).

One program per ``BLOCK_M x BLOCK_N`` tile of the output walks its rows' ``K`` inputs once, in
blocks of ``BLOCK_K``: the residual add ``h = round(x + delta)`` (rounded to the input dtype, as
Megatron's bias-dropout-add; the programs of the first column block store ``h``), each row's sum
of squares, and ``round(h * g)`` (the RMSNorm's weight ``g``) times the weight's ``BLOCK_N x
BLOCK_K`` tiles, accumulated in fp32. The RMSNorm's ``rstd = 1 / sqrt(mean(h^2) + eps)``, a
scalar a row, multiplies the fp32 product after the loop: ``rstd * sum_k round(h g) w`` where the
unfused layer computes ``sum_k round(h rstd g) w`` (the same in exact arithmetic; the input
rounded before the row's scale instead of after it), so the loop needs no first pass over the
rows for their norms.

With ``SWIGLU`` the program also accumulates the weight's rows ``N + n`` (the up projection, after
the gate's ``N`` rows: Megatron's ``linear_fc1`` layout) and stores ``round(silu(gate) * up)`` in
fp32 from the two products, each rounded to the output dtype first (as the compiled decode layer's
fused SwiGLU kernel reads the rounded ``linear_fc1`` output). ``UPCAST``: the products in fp32 from
the same rounded operands (Triton's interpreter multiplies 16-bit floats' bits as integers)."""

import triton
import triton.language as tl


@triton.jit
def _rows_in(x_ptr, d_ptr, rm, rk, inside, stride_x, HAS_DELTA: tl.constexpr):
    """The block's inputs ``[BLOCK_M, BLOCK_K]`` in fp32: ``x``, or ``round(x + delta)``."""
    offs = rm[:, None] * stride_x + rk[None, :]
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(d_ptr + offs, mask=inside, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def norm_matmul_kernel(x_ptr, d_ptr, h_ptr, g_ptr, w_ptr, o_ptr, M, N, K, stride_x, stride_h,
                       stride_w, stride_o, eps, HAS_DELTA: tl.constexpr, SWIGLU: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``o[m, n] = sum_k round(rms_norm(h)[m, k]) * w[n, k]`` (module docstring); ``x``,
    ``delta`` ``[M, K]`` with row stride ``stride_x`` and ``h`` with ``stride_h`` (last dims
    contiguous), ``g`` ``[K]``, ``w`` ``[N or 2N, K]`` with row stride ``stride_w``, ``o``
    ``[M, N]`` with ``stride_o``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = rm < M
    in_n = rn < N
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_k = rk < K
        inside = in_m[:, None] & in_k[None, :]
        h = _rows_in(x_ptr, d_ptr, rm, rk, inside, stride_x, HAS_DELTA)
        if HAS_DELTA:
            if pid_n == 0:
                tl.store(h_ptr + rm[:, None] * stride_h + rk[None, :],
                         h.to(h_ptr.dtype.element_ty), mask=inside)
        squares += tl.sum(h * h, axis=1)
        g = tl.load(g_ptr + rk, mask=in_k, other=0.0).to(tl.float32)
        a = (h * g[None, :]).to(w_ptr.dtype.element_ty)
        w_mask = in_n[:, None] & in_k[None, :]
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=w_mask, other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        if SWIGLU:
            w = tl.load(w_ptr + (rn + N)[:, None] * stride_w + rk[None, :], mask=w_mask,
                        other=0.0)
            if UPCAST:
                up += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)),
                             input_precision="ieee")
            else:
                up = tl.dot(a, tl.trans(w), up, input_precision=PRECISION)
    rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = acc * rstd[:, None]
    out = acc
    if SWIGLU:
        gate = acc.to(o_ptr.dtype.element_ty).to(tl.float32)
        up = (up * rstd[:, None]).to(o_ptr.dtype.element_ty).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
    tl.store(o_ptr + rm[:, None] * stride_o + rn[None, :], out.to(o_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_n[None, :])
