"""One fused decode attention over the KV cache (``generation.decode_attention=triton``): a
Triton flash-decoding kernel for the compiled decode layers (:mod:`mcore_rl.megatron.decode_layer`,
issue 37 item 1's hand-fused kernel where the compiler does not fuse).

Why: :func:`~mcore_rl.megatron.attention.decode_attention` is three kernels a layer (scores
product, softmax, values product; cuBLAS's small tiles, the scores written to memory and read
back), about 0.9 ms of a 2.4 ms decode step of SmolLM2-135M at 256 rows on one H200
(bench/RESULTS.md), and torch's FlexAttention took 2.35 ms for the same work (its main kernel,
not its decoding one). Here one program per (row, KV group) reads that row's keys and values
once, keeps the ``np / ng`` query heads' scores in registers and the softmax online in fp32
(FlashAttention, Dao et al. 2022, arXiv:2205.14135, Algorithm 1's running max and sum), and
writes the output once: one kernel a layer. A row's loops stop after the last key its mask
keeps: the decoder's spans are powers of two (a CUDA graph a bucket), so up to half of a span is
padding that is masked whole; skipping it changes no bit of the result.

With shared prompts (``generation.shared_prompt_kv``, :func:`~mcore_rl.megatron.attention.
shared_decode_attention`'s layout) a program first walks its group's prompt keys, then its own
response keys, one online softmax over both; the ``G`` rows of a group are adjacent programs,
so the prompt's keys come from L2 after the first of them.

:func:`flash_decode_rope` (``generation.decode_attention=triton_rope``) starts from the QKV
projection's output instead: each program also rotates its group's queries and key (RoPE in
fp32, rounded once, as the compiled layer does) and writes the key and value into the cache
before it attends, where the compiled layer spent two more kernels a layer on that.

The op is ``torch.ops.mcore_rl.flash_decode`` (``torch.library.custom_op``): opaque to
torch.compile and capturable in a CUDA graph. On CUDA it launches the kernel; on other devices
it computes the same attention unfused in fp32 (:func:`reference_decode`), the kernel's
arithmetic without its blocking. The kernel itself runs on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, tests/test_flash_decode.py).

Numbers: not bit for bit :func:`~mcore_rl.megatron.attention.decode_attention`, which rounds the
scores and probabilities to the input dtype: here scores are fp32 (bf16 products accumulated in
fp32), the probabilities are rounded to the values' dtype for the values' product (as
FlashAttention does), the output once. fp32: within 1e-5 of :func:`reference_decode` per element
(tests, interpreter); bf16 on the GPU: ``scripts/gpu/decode_step_profile.py``'s
``compile+triton`` variants against ``base``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from mcore_rl.megatron.attention import decode_attention, shared_decode_attention, write_kv
from mcore_rl.megatron.rope import rotate_with

# keys per block of the loop over the span and warps a program (the fastest of 16 tunings on
# one H200 at SmolLM2-135M's attention, 256 rows, in a CUDA graph: 20.0 us a call over rows'
# own 300 keys, 15.7 us with shared prompts, against 20.0 / 23.9 at 64 keys and 4 warps and
# bmm's 47.6: scripts/gpu/flash_decode_bench.py). With the loops stopped after each row's last
# kept key (tail_skip, 2026-11-28, sixth session): 15.3 / 14.2 us, and 18.8 against 26.6 at the
# GSM8K step's power-of-two spans (prompts 256, responses 256 at token 160); 64 keys and 2 warps
# were within 1.2 us of it either way. A program's query heads padded to a block of _BLOCK_Q
# rows (tl.dot's smallest M)
_BLOCK_N = 32
_NUM_WARPS = 2
_BLOCK_Q = 16


def _kernel(name: str = "flash_decode_kernel"):
    """A Triton kernel of :mod:`mcore_rl.megatron.flash_decode_kernel` by name, imported at
    first use: Triton is loaded only where the op runs on CUDA or under the interpreter."""
    from mcore_rl.megatron import flash_decode_kernel

    return getattr(flash_decode_kernel, name)


def _check(query, keys, values, mask, prompt_keys, prompt_values) -> None:
    """Raise ``ValueError`` naming what does not fit :func:`flash_decode`'s layout."""
    b, ng, s, d = keys.shape
    if query.dim() != 3 or query.shape[0] != b or query.shape[1] % ng:
        raise ValueError(f"flash_decode: query {tuple(query.shape)} is not [B={b}, np, d] with "
                         f"np a multiple of the {ng} KV groups")
    if values.shape != keys.shape or query.shape[2] != d:
        raise ValueError(f"flash_decode: keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)}, query {tuple(query.shape)} differ")
    sp = 0 if prompt_keys is None else prompt_keys.shape[2]
    if mask.shape != (b, sp + s) or mask.dtype != torch.bool:
        raise ValueError(f"flash_decode: mask {tuple(mask.shape)} {mask.dtype} is not bool "
                         f"[{b}, {sp + s}]")
    if prompt_keys is not None and (prompt_values is None
                                    or prompt_values.shape != prompt_keys.shape
                                    or b % prompt_keys.shape[0]):
        raise ValueError("flash_decode: prompt keys and values must match and divide the rows")


def reference_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor, scale: float,
                     prompt_keys: Optional[torch.Tensor] = None,
                     prompt_values: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel's attention computed by the unfused decode attentions on fp32 copies of the
    inputs (:func:`~mcore_rl.megatron.attention.decode_attention`, or
    :func:`~mcore_rl.megatron.attention.shared_decode_attention` with shared prompts: scores,
    softmax and the weighted sum all in fp32), rounded once to the query's dtype. Arguments as
    :func:`flash_decode`. Returns ``[B, np, d]``."""
    q, k, v = query.float()[None], keys.float(), values.float()
    if prompt_keys is None:
        out = decode_attention(q, k, v, mask, scale)
    else:
        out = shared_decode_attention(q, prompt_keys.float(), prompt_values.float(), k, v, mask,
                                      scale)
    return out.view(query.shape).to(query.dtype)


def _attention_args(query, keys, values, mask, prompt_keys, prompt_values, block_n, num_warps,
                    tail_skip):
    """Check the layout (:func:`_check`, and what the kernel needs beyond it) and return the
    attention's arguments after the output strides, as both kernels take them: the mask bytes,
    prompt keys and values, their strides, the spans and sizes, and the constexpr keywords."""
    _check(query, keys, values, mask, prompt_keys, prompt_values)
    b, ng, s, d = keys.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"flash_decode: head size {d} is not a power of two >= 16")
    nq = query.shape[1] // ng
    if nq > _BLOCK_Q:
        raise ValueError(f"flash_decode: {nq} query heads per KV group, over {_BLOCK_Q}")
    for name, t in (("keys", keys), ("values", values)):
        if t.stride(-1) != 1:
            raise ValueError(f"flash_decode: {name}' last dim is not contiguous")
    if keys.stride() != values.stride():
        raise ValueError("flash_decode: keys and values need the same strides")
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    mask_bytes = mask.view(torch.uint8)
    if prompt_keys is None:
        pk = pv = keys
        pstride, sp, group_rows = keys.stride(), 0, 1
    else:
        if prompt_keys.stride() != prompt_values.stride() or prompt_keys.stride(-1) != 1:
            raise ValueError("flash_decode: prompt keys and values need the same strides")
        pk, pv = prompt_keys, prompt_values
        pstride, sp, group_rows = prompt_keys.stride(), prompt_keys.shape[2], \
            b // prompt_keys.shape[0]
    args = (keys.stride(0), keys.stride(1), keys.stride(2), mask_bytes.stride(0), pstride[0],
            pstride[1], pstride[2], ng, s, sp, group_rows, nq)
    meta = dict(D=d, BLOCK_Q=_BLOCK_Q, BLOCK_N=block_n, num_warps=num_warps,
                PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
                UPCAST=query.device.type != "cuda" and query.dtype != torch.float32,
                TAIL_SKIP=tail_skip, SPAN_P2=1 << (max(s, sp, 1) - 1).bit_length())
    return mask_bytes, pk, pv, args, meta


def launch(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           scale: float, prompt_keys: Optional[torch.Tensor] = None,
           prompt_values: Optional[torch.Tensor] = None, block_n: int = _BLOCK_N,
           num_warps: int = _NUM_WARPS, tail_skip: bool = True) -> torch.Tensor:
    """Run the Triton kernel (on CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``).
    Arguments and result as :func:`flash_decode`; ``block_n`` keys a block (a power of two
    >= 16) and ``num_warps`` a program are the kernel's tuning
    (``scripts/gpu/flash_decode_bench.py``); ``tail_skip``: each row's loops stop after the
    last key its mask keeps (the same result bit for bit, :mod:`.flash_decode_kernel`; False
    walks the whole span, as before)."""
    if query.stride(-1) != 1:
        raise ValueError("flash_decode: query' last dim is not contiguous")
    mask_bytes, pk, pv, args, meta = _attention_args(query, keys, values, mask, prompt_keys,
                                                     prompt_values, block_n, num_warps,
                                                     tail_skip)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if query.stride() != out.stride():
        query = query.contiguous()
    b, ng = keys.shape[:2]
    _kernel()[(b * ng,)](query, keys, values, mask_bytes, pk, pv, out, query.stride(0),
                         query.stride(1), *args, scale, **meta)
    return out


def _query_heads(qkv: torch.Tensor, keys: torch.Tensor) -> int:
    """The query heads a KV group ``nq`` of ``qkv`` ``[B, ng, (nq + 2) d]`` (the QKV
    projection's output, Megatron's per-group layout); ``ValueError`` naming a shape that does
    not match ``keys`` ``[B, ng, S, d]``."""
    b, ng, _, d = keys.shape
    if qkv.dim() != 3 or qkv.shape[:2] != (b, ng) or qkv.shape[2] % d or qkv.shape[2] < 3 * d:
        raise ValueError(f"flash_decode_rope: qkv {tuple(qkv.shape)} is not [B={b}, ng={ng}, "
                         f"(np / ng + 2) * {d}]")
    return qkv.shape[2] // d - 2


def _split_qkv(qkv: torch.Tensor, keys: torch.Tensor):
    """``qkv`` (:func:`_query_heads`) as its query ``[B, ng nq, d]`` (a copy: the groups' keys
    and values lie between their queries), key and value ``[B, ng, d]``."""
    b, _, _, d = keys.shape
    nq = _query_heads(qkv, keys)
    query, key, value = torch.split(qkv, [nq * d, d, d], dim=2)
    return query.reshape(b, -1, d), key, value


def rope_rows(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``t`` ``[B, heads, d]`` with each row's ``cos`` and ``signed_sin`` ``[B, d]``
    (:func:`mcore_rl.megatron.rope.cos_sin`'s: the sine's first half negated), as the fused
    kernel computes it: ``t * cos + cat(t2, t1) * signed_sin`` in fp32, rounded once to
    ``t``'s dtype (RoFormer, Su et al. 2021, eq. 34)."""
    return rotate_with(t.float(), cos.float()[:, None], signed_sin.float()[:, None]).to(t.dtype)


def launch_rope(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                at: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float, prompt_keys: Optional[torch.Tensor] = None,
                prompt_values: Optional[torch.Tensor] = None, block_n: int = _BLOCK_N,
                num_warps: int = _NUM_WARPS, tail_skip: bool = True) -> torch.Tensor:
    """Run the fused kernel (``flash_decode_rope_kernel``: RoPE, the KV-cache write and the
    attention in one launch) on CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``.
    Arguments and result as :func:`flash_decode_rope`; tuning as :func:`launch`."""
    b, ng, _, d = keys.shape
    # the query's shape, dtype and device for the checks, without _split_qkv's copy (a kernel a
    # layer on the GPU: 2.4 us of each decode layer on one H200, bench/RESULTS.md)
    query = qkv.new_empty(()).expand(b, ng * _query_heads(qkv, keys), d)
    if qkv.stride(-1) != 1 or qkv.stride(1) != qkv.shape[2]:
        raise ValueError("flash_decode_rope: qkv's groups are not contiguous rows")
    if cos.shape != (b, d) or signed_sin.shape != cos.shape or cos.stride() != signed_sin.stride() \
            or cos.stride(-1) != 1 or at.shape != (b,):
        raise ValueError(f"flash_decode_rope: cos, signed_sin must be [B={b}, d={d}] with the "
                         f"same strides and at [B], got {tuple(cos.shape)}, "
                         f"{tuple(signed_sin.shape)}, {tuple(at.shape)}")
    mask_bytes, pk, pv, args, meta = _attention_args(query, keys, values, mask, prompt_keys,
                                                     prompt_values, block_n, num_warps,
                                                     tail_skip)
    out = torch.empty(query.shape, dtype=qkv.dtype, device=qkv.device)
    _kernel("flash_decode_rope_kernel")[(b * ng,)](
        qkv, cos, signed_sin, at, keys, values, mask_bytes, pk, pv, out, qkv.stride(0),
        qkv.stride(1), cos.stride(0), out.stride(0), out.stride(1), *args, scale, **meta)
    return out


@torch.library.custom_op("mcore_rl::flash_decode", mutates_args=())
def flash_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor, scale: float, prompt_keys: Optional[torch.Tensor] = None,
                 prompt_values: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention of one query per row over the KV cache, fused (module docstring).

    Args:
        query: ``[B, np, d]`` (Megatron's head order: head ``h`` in KV group ``h // (np /
            ng)``), the last dim contiguous.
        keys, values: ``[B, ng, S, d]``, views of the cache buffers (the same strides; last
            dim contiguous): row ``r``'s keys at positions (or response tokens) ``0 .. S-1``.
        mask: ``[B, Sp + S]`` bool, True = masked out (``Sp``: the prompt span, 0 without
            shared prompts); every row keeps at least one key.
        scale: the softmax scale.
        prompt_keys, prompt_values: ``[P, ng, Sp, d]`` the groups' shared prompts (rows ``p * G
            .. p * G + G - 1``, ``G = B / P``, read group ``p``'s), or None.

    Returns:
        ``[B, np, d]`` in ``query``'s dtype.

    Raises:
        ValueError: shapes, dtypes or strides outside that layout (named); on CUDA also a head
            size that is not a power of two >= 16, or more than 16 query heads per KV group.
    """
    if query.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return launch(query, keys, values, mask, scale, prompt_keys, prompt_values)
    _check(query, keys, values, mask, prompt_keys, prompt_values)
    return reference_decode(query, keys, values, mask, scale, prompt_keys, prompt_values)


@flash_decode.register_fake
def _(query, keys, values, mask, scale, prompt_keys=None, prompt_values=None):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op("mcore_rl::flash_decode_rope", mutates_args=("keys", "values"))
def flash_decode_rope(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                      at: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor, scale: float,
                      prompt_keys: Optional[torch.Tensor] = None,
                      prompt_values: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A decode step's attention from the QKV projection's output: RoPE of the query and key,
    the key and value written into the cache, and :func:`flash_decode`'s attention, in one
    kernel on CUDA (``generation.decode_attention=triton_rope``; where the compiled decode
    layer spent two more kernels a layer on RoPE and the cache write). Elsewhere the same
    arithmetic unfused: :func:`rope_rows`, the write, :func:`reference_decode`.

    Args:
        qkv: ``[B, ng, (np / ng + 2) d]`` the QKV projection's output (+ bias) of one token a
            row, Megatron's layout (each KV group's queries, then its key, then its value), the
            last two dims contiguous.
        cos, signed_sin: ``[B, d]`` each row's RoPE cosine and sine with its first half negated
            (:func:`mcore_rl.megatron.rope.cos_sin`; a rotary dimension of the whole head), the
            same strides, last dim contiguous.
        at: ``[B]`` int64, the slot of row ``r``'s new key and value in ``keys[r]`` /
            ``values[r]`` (:meth:`~mcore_rl.megatron.attention.KVCache.target`; ``< S``, as
            the decoder's spans hold every row's step).
        keys, values: ``[B, ng, S, d]`` views of the cache buffers from their first row and
            slot (written at ``at`` in place, then read as :func:`flash_decode` reads them);
            ``mask``, ``scale``, ``prompt_keys``, ``prompt_values`` as :func:`flash_decode`'s
            (the mask keeps each row's slot ``at``).

    Returns:
        ``[B, np, d]`` in ``qkv``'s dtype: the attention's output.

    Raises:
        ValueError: shapes, dtypes or strides outside that layout (named), as
            :func:`flash_decode`.
    """
    if qkv.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return launch_rope(qkv, cos, signed_sin, at, keys, values, mask, scale, prompt_keys,
                           prompt_values)
    query, key, value = _split_qkv(qkv, keys)
    _check(query, keys, values, mask, prompt_keys, prompt_values)
    write_kv(keys, values, torch.arange(keys.shape[0], device=keys.device), at,
             rope_rows(key, cos, signed_sin), value)
    return reference_decode(rope_rows(query, cos, signed_sin), keys, values, mask, scale,
                            prompt_keys, prompt_values)


@flash_decode_rope.register_fake
def _(qkv, cos, signed_sin, at, keys, values, mask, scale, prompt_keys=None,
      prompt_values=None):
    b, ng, _, d = keys.shape
    return qkv.new_empty(b, qkv.shape[2] // d * ng - 2 * ng, d)
