"""The Triton kernel of :func:`mcore_rl.megatron.norm_matmul.norm_matmul` (imported by it at
first use; ``TRITON_INTERPRET=1`` before this import runs it on CPU tensors).

One program per ``BLOCK_M x BLOCK_N`` tile of the output. It walks its rows' ``K`` inputs twice:

1. the residual add ``h = round(x + delta)`` (rounded to the input dtype, as Megatron's
   bias-dropout-add; the programs of the first column block store ``h``) and each row's sum of
   squares, for the RMSNorm's ``rstd = 1 / sqrt(mean(h^2) + eps)`` in fp32;
2. ``round(h * rstd * g)`` (the RMSNorm in fp32, rounded once, as ``torch.nn.functional.rms_norm``
   rounds its output) times the weight's ``BLOCK_K x BLOCK_N`` tiles, accumulated in fp32.

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
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        inside = in_m[:, None] & (rk < K)[None, :]
        h = _rows_in(x_ptr, d_ptr, rm, rk, inside, stride_x, HAS_DELTA)
        if HAS_DELTA:
            if pid_n == 0:
                tl.store(h_ptr + rm[:, None] * stride_h + rk[None, :],
                         h.to(h_ptr.dtype.element_ty), mask=inside)
        squares += tl.sum(h * h, axis=1)
    rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_k = rk < K
        h = _rows_in(x_ptr, d_ptr, rm, rk, in_m[:, None] & in_k[None, :], stride_x, HAS_DELTA)
        g = tl.load(g_ptr + rk, mask=in_k, other=0.0).to(tl.float32)
        a = (h * rstd[:, None] * g[None, :]).to(w_ptr.dtype.element_ty)
        w_mask = in_k[:, None] & in_n[None, :]
        w = tl.load(w_ptr + rn[None, :] * stride_w + rk[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SWIGLU:
            w = tl.load(w_ptr + (rn + N)[None, :] * stride_w + rk[:, None], mask=w_mask,
                        other=0.0)
            if UPCAST:
                up += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                up = tl.dot(a, w, up, input_precision=PRECISION)
    out = acc
    if SWIGLU:
        gate = acc.to(o_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(o_ptr.dtype.element_ty).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
    tl.store(o_ptr + rm[:, None] * stride_o + rn[None, :], out.to(o_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_n[None, :])
