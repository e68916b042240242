"""The Triton kernel of :func:`mcore_rl.megatron.flash_decode.flash_decode` (imported by it at
first use; ``TRITON_INTERPRET=1`` before this import runs it on CPU tensors). One program per
(row, KV group): the group's ``nq`` query heads (padded to ``BLOCK_Q`` rows) against the keys in
blocks of ``BLOCK_N``, an online softmax in fp32 (FlashAttention, Dao et al. 2022,
arXiv:2205.14135, Algorithm 1), first over the row's group's shared prompt keys (when
``prompt_span > 0``), then over the row's own keys. With ``TAIL_SKIP`` each part's loop stops
after the last key the row's mask keeps (found from one load of its mask bytes, ``SPAN_P2`` wide):
the blocks after it are masked whole, and their online-softmax update would leave the running
max, sum and output unchanged (``exp(-inf) = 0``, ``alpha = exp(0) = 1``), so the result is the
same bit for bit while a span bucket's padding (a prompt span rounded up to a power of two, a
response span ahead of the step) costs no loads."""

import triton
import triton.language as tl


@triton.jit
def _kept(mask_ptr, span, SPAN_P2: tl.constexpr):
    """One past the last of the ``span`` keys at ``mask_ptr`` that the mask keeps (0: none)."""
    n = tl.arange(0, SPAN_P2)
    keep = tl.load(mask_ptr + n, mask=n < span, other=1) == 0
    return tl.max(tl.where(keep, n + 1, 0), 0)


@triton.jit
def _part(acc, m_i, l_i, q, k_ptr, v_ptr, sk_s, mask_ptr, span, scale,
          D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
          UPCAST: tl.constexpr, TAIL_SKIP: tl.constexpr, SPAN_P2: tl.constexpr):
    """One part of the keys (prompt or response): the online softmax over ``span`` keys
    at ``k_ptr``/``v_ptr`` (slot stride ``sk_s``), mask bytes at ``mask_ptr``; with
    ``TAIL_SKIP`` only up to the last key kept (module docstring). ``UPCAST``: the products in
    fp32 from the same (rounded) operands (Triton's interpreter multiplies 16-bit floats' bits
    as integers)."""
    d = tl.arange(0, D)
    end = span
    if TAIL_SKIP:
        end = _kept(mask_ptr, span, SPAN_P2)
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < span
        k = tl.load(k_ptr + n[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = s * scale  # [BQ, BN] fp32
        masked = tl.load(mask_ptr + n, mask=inside, other=1) != 0
        s = tl.where(masked[None, :], float("-inf"), s)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + n[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0)
        p = p.to(v.dtype)  # rounded for the values' product, as FlashAttention
        if UPCAST:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend(q, b, g, k_ptr, v_ptr, mask_ptr, pk_ptr, pv_ptr, out_ptr, so_b, so_h, sk_b, sk_g,
            sk_s, sm_b, spk_b, spk_g, spk_s, span, prompt_span, group_rows, nq, scale,
            D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr, UPCAST: tl.constexpr, TAIL_SKIP: tl.constexpr,
            SPAN_P2: tl.constexpr):
    """Row ``b``'s KV group ``g``: the queries ``q`` ``[BLOCK_Q, D]`` (heads past ``nq`` zero)
    over the group's shared prompt keys (``prompt_span > 0``), then the row's own, one online
    softmax; the output heads stored at ``out_ptr`` (row stride ``so_b``, head stride
    ``so_h``)."""
    h = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, D)
    heads = h < nq
    m_i = tl.full([BLOCK_Q], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, D], tl.float32)
    if prompt_span > 0:
        p = b // group_rows
        acc, m_i, l_i = _part(acc, m_i, l_i, q, pk_ptr + p * spk_b + g * spk_g,
                              pv_ptr + p * spk_b + g * spk_g, spk_s, mask_ptr + b * sm_b,
                              prompt_span, scale, D, BLOCK_N, PRECISION, UPCAST, TAIL_SKIP,
                              SPAN_P2)
    acc, m_i, l_i = _part(acc, m_i, l_i, q, k_ptr + b * sk_b + g * sk_g,
                          v_ptr + b * sk_b + g * sk_g, sk_s,
                          mask_ptr + b * sm_b + prompt_span, span, scale, D, BLOCK_N,
                          PRECISION, UPCAST, TAIL_SKIP, SPAN_P2)
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * so_b + (g * nq + h[:, None]) * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=heads[:, None])


@triton.jit
def flash_decode_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, pk_ptr, pv_ptr, out_ptr,
                        sq_b, sq_h, sk_b, sk_g, sk_s, sm_b, spk_b, spk_g, spk_s,
                        groups, span, prompt_span, group_rows, nq, scale,
                        D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, TAIL_SKIP: tl.constexpr,
                        SPAN_P2: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // groups
    g = pid % groups
    h = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, D)
    q_rows = q_ptr + b * sq_b + (g * nq + h[:, None]) * sq_h + d[None, :]
    q = tl.load(q_rows, mask=(h < nq)[:, None], other=0.0)
    _attend(q, b, g, k_ptr, v_ptr, mask_ptr, pk_ptr, pv_ptr, out_ptr, sq_b, sq_h, sk_b, sk_g,
            sk_s, sm_b, spk_b, spk_g, spk_s, span, prompt_span, group_rows, nq, scale, D,
            BLOCK_Q, BLOCK_N, PRECISION, UPCAST, TAIL_SKIP, SPAN_P2)


@triton.jit
def flash_decode_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, at_ptr, k_ptr, v_ptr, mask_ptr, pk_ptr,
                             pv_ptr, out_ptr, sx_b, sx_g, sc_b, so_b, so_h, sk_b, sk_g, sk_s,
                             sm_b, spk_b, spk_g, spk_s, groups, span, prompt_span, group_rows,
                             nq, scale, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                             UPCAST: tl.constexpr, TAIL_SKIP: tl.constexpr,
                             SPAN_P2: tl.constexpr):
    """:func:`flash_decode_kernel` from the QKV projection's output: the program of row ``b``,
    group ``g`` rotates its group's key (RoPE, Su et al. 2021, eq. 34, non-interleaved halves:
    ``t * cos + cat(t2, t1) * signed_sin`` in fp32, rounded once to the cache's dtype) and writes
    it with the value at the row's slot ``at[b]`` of the cache, then (after a barrier: its own
    threads read that slot back) rotates its ``nq`` queries and attends as
    :func:`flash_decode_kernel` does."""
    pid = tl.program_id(0)
    b = pid // groups
    g = pid % groups
    h = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, D)
    rot = (d + D // 2) % D  # cat(t2, t1)'s columns
    cos = tl.load(cos_ptr + b * sc_b + d).to(tl.float32)
    sin = tl.load(sin_ptr + b * sc_b + d).to(tl.float32)
    base = qkv_ptr + b * sx_b + g * sx_g
    key = tl.load(base + nq * D + d).to(tl.float32) * cos \
        + tl.load(base + nq * D + rot).to(tl.float32) * sin
    slot = tl.load(at_ptr + b)
    cache = b * sk_b + g * sk_g + slot * sk_s + d
    tl.store(k_ptr + cache, key.to(k_ptr.dtype.element_ty))
    tl.store(v_ptr + cache, tl.load(base + (nq + 1) * D + d))
    tl.debug_barrier()  # the slot is read back below, by other threads of this program
    heads = (h < nq)[:, None]
    q = tl.load(base + h[:, None] * D + d[None, :], mask=heads, other=0.0).to(tl.float32) \
        * cos[None, :] \
        + tl.load(base + h[:, None] * D + rot[None, :], mask=heads, other=0.0).to(tl.float32) \
        * sin[None, :]
    _attend(q.to(k_ptr.dtype.element_ty), b, g, k_ptr, v_ptr, mask_ptr, pk_ptr, pv_ptr,
            out_ptr, so_b, so_h, sk_b, sk_g, sk_s, sm_b, spk_b, spk_g, spk_s, span, prompt_span,
            group_rows, nq, scale, D, BLOCK_Q, BLOCK_N, PRECISION, UPCAST, TAIL_SKIP, SPAN_P2)
