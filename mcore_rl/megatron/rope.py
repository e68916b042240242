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
``searchsorted``; with context parallelism, of this CP rank's tokens only), gathers
``freqs[pos]`` once per micro-batch (cached on the ``cu_seqlens`` tensor object, which every
layer of a forward shares) and rotates the whole ``[t, h, d]`` tensor with Megatron's own BSHD
function: the formula of Su et al. 2021 ("RoFormer", eq. 34), as Megatron applies it to each
sequence from position 0. :func:`install` puts it in Megatron's place for per-sequence
frequencies (Megatron's "CASE 2", at any CP size); frequencies of the whole packed batch go to
Megatron's function.

:func:`rotate` is Megatron's BSHD rotation (``_apply_rotary_pos_emb_bshd``: the same numbers,
bit for bit) with fewer kernels, which matters where the model is small and the step is a
string of small launches (a decode step of SmolLM2-135M: 30 layers, ~1,500 kernels, ~20 of
them per layer Megatron's RoPE; bench/RESULTS.md): Megatron computes ``cos`` and ``sin`` of
the frequencies, scales and casts them for the query and again for the key of every layer
(12 kernels per tensor); :func:`rotate` computes them once per frequency tensor (every layer of
a forward shares it) and rotates with 4 (``cat``, two products, a sum). :func:`install` puts
both in Megatron's place.
"""

from __future__ import annotations

import torch

_cache: dict = {}  # one entry: (cu_seqlens, freqs, total tokens) -> packed freqs
_trig: dict = {}  # one entry: (freqs, dtype, mscale) -> (cos, signed sin)


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype, mscale: float):
    """``(cos(freqs) * mscale, sin(freqs) * mscale)`` in ``dtype`` as Megatron rounds them, the
    sine's first half negated (the sign of ``rotate_half``); cached on the ``freqs`` object."""
    key = (dtype, mscale, torch.is_inference_mode_enabled())
    hit = _trig.get("entry")
    if hit is not None and hit[0][0] is freqs and hit[0][1:] == key:
        return hit[1]
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    cos, sin = cos.to(dtype), sin.to(dtype)
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    _trig["entry"] = ((freqs, *key), (cos, signed))
    return cos, signed


def cos_sin(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0):
    """``(cos, signed sin)`` of ``freqs`` as :func:`rotate` uses them (cosine and sine times
    ``mscale`` in ``dtype``, the sine's first half negated): for callers that rotate with the
    same numbers themselves (:mod:`mcore_rl.megatron.decode_layer`)."""
    return _cos_sin(freqs, dtype, mscale)


def rotate(original, t: torch.Tensor, freqs: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Megatron-Core's ``_apply_rotary_pos_emb_bshd`` (RoFormer, Su et al. 2021, eq. 34,
    non-interleaved halves) with ``cos``/``sin`` computed once per ``freqs`` tensor.

    ``t * cos + rotate_half(t) * sin`` with ``rotate_half(t) = cat(-t2, t1)`` is computed as
    ``t * cos + cat(t2, t1) * cat(-sin1, sin2)``: the same products (``(-a) b = a (-b)``
    exactly), so the result equals Megatron's bit for bit in any dtype.

    Args:
        original: Megatron's function, called for what this one does not do (positional extra
            arguments, interleaved or multi-latent rotations).
        t: ``[s, b, h, d]`` (or any ``[..., d]``) queries or keys; ``freqs``: ``[s, b | 1, 1,
            d_rot]`` float32 angles (``d_rot <= d``, even). ``mscale`` keyword as Megatron's.

    Returns:
        The rotated tensor, ``t``'s shape and dtype (the last ``d - d_rot`` channels passed
        through).
    """
    if args or kwargs.get("rotary_interleaved") or kwargs.get("mla_rotary_interleaved") \
            or kwargs.get("multi_latent_attention") \
            or set(kwargs) - {"rotary_interleaved", "mla_rotary_interleaved", "mscale",
                              "multi_latent_attention"}:
        return original(t, freqs, *args, **kwargs)
    cos, signed = _cos_sin(freqs, t.dtype, float(kwargs.get("mscale", 1.0)))
    return rotate_with(t, cos, signed)


def rotate_with(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotate`'s arithmetic with a given cosine and signed sine (:func:`cos_sin`'s):
    ``t * cos + cat(t2, t1) * signed_sin`` over the first ``d_rot`` channels (RoFormer, Su et
    al. 2021, eq. 34, non-interleaved halves), the other ``d - d_rot`` passed through.

    Args:
        t: ``[..., d]`` queries or keys; ``cos``, ``signed_sin``: ``[..., d_rot]``
            broadcastable to ``t[..., :d_rot]`` (``d_rot <= d``, even).

    Returns:
        ``t``'s shape, in the dtype the products promote to (``t``'s for ``cos`` in it).
    """
    rot_dim = cos.shape[-1]
    head, rest = (t, None) if rot_dim == t.shape[-1] else (t[..., :rot_dim], t[..., rot_dim:])
    half = rot_dim // 2
    out = head * cos + torch.cat((head[..., half:], head[..., :half]), dim=-1) * signed_sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


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
    idx = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # doc(i) = (starts <= i) - 1, searched in cu_seqlens itself: searching its ends
    # (cu_seqlens[1:], a view) fails in torch 2.11's Inductor (searchsorted's lowering reads
    # the boundaries' strides, which a SliceView lacks) inside policy.megatron.compile_layers
    doc = torch.searchsorted(cu_seqlens, idx, right=True).sub_(1)
    doc = doc.clamp_(max=cu_seqlens.numel() - 2)
    return (idx - cu_seqlens[doc]).to(torch.int64)


def packed_rope(original, t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                *args, cp_group=None, **kwargs) -> torch.Tensor:
    """RoPE of a packed ``[t, h, d]`` tensor, each sequence rotated from position 0.

    Context parallelism (``cp_group`` of CP > 1 ranks): ``t`` holds this rank's two chunks of
    every sequence of ``cu_seqlens`` (each sequence's length a multiple of ``2 CP``:
    :func:`mcore_rl.megatron.context_parallel.local_positions`), rotated by the frequencies of
    their positions in the sequence, as Megatron's ``_get_thd_freqs_on_this_cp_rank`` slices
    them sequence by sequence.

    Args:
        original: Megatron's ``_apply_rotary_pos_emb_thd`` (called for frequencies that cover
            the whole packed batch).
        t: ``[T / CP, h, d]`` packed queries or keys; ``cu_seqlens``: ``[n + 1]`` with
            ``cu_seqlens[-1] = T``; ``freqs``: ``[max_s, 1, 1, d_rot]`` (max_s >= the longest
            sequence). Other arguments as Megatron's.

    Returns:
        ``[T / CP, h, d]`` in ``t``'s dtype, equal to Megatron's result.
    """
    from megatron.core.models.common.embeddings import rope_utils

    from mcore_rl.megatron import context_parallel

    cp = 1 if cp_group is None else cp_group.size()
    rank = 0 if cp == 1 else cp_group.rank()
    total = t.shape[0] * cp  # the packed row's tokens
    if freqs.shape[0] == total:
        return original(t, cu_seqlens, freqs, *args, cp_group=cp_group, **kwargs)
    key = (cu_seqlens, freqs, total, cp, rank)
    hit = _cache.get("entry")
    if hit is None or any(a is not b for a, b in zip(hit[0][:2], key[:2])) or hit[0][2:] != key[2:]:
        pos = packed_positions(cu_seqlens.to(freqs.device, non_blocking=True), total)
        if cp > 1:
            pos = pos[context_parallel.local_positions(total, cp, rank, pos.device, cu_seqlens)]
        hit = (key, freqs[pos])
        _cache["entry"] = hit
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), hit[1], *args, **kwargs).squeeze(1)


def megatron_function(name: str):
    """Megatron-Core's own ``rope_utils.<name>`` (``"_apply_rotary_pos_emb_bshd"`` or
    ``"_apply_rotary_pos_emb_thd"``), also after :func:`install` replaced it."""
    from megatron.core.models.common.embeddings import rope_utils

    current = getattr(rope_utils, name)
    return current.args[0] if getattr(current, "_mcore_rl", False) else current


def install() -> None:
    """Put :func:`packed_rope` and :func:`rotate` in Megatron-Core's place (idempotent; every
    Megatron worker calls it at start-up)."""
    import functools

    from megatron.core.models.common.embeddings import rope_utils

    for name, ours in (("_apply_rotary_pos_emb_thd", packed_rope),
                       ("_apply_rotary_pos_emb_bshd", rotate)):
        current = getattr(rope_utils, name)
        if getattr(current, "_mcore_rl", False):
            continue
        patched = functools.partial(ours, current)
        patched._mcore_rl = True
        setattr(rope_utils, name, patched)
