"""Megatron core attention on ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

:class:`TorchSDPAttention` is a drop-in for Megatron-Core's ``DotProductAttention`` (the core
attention of the local layer spec; same constructor and forward signature in megatron-core
0.16 and 0.19, it subclasses it): instead of materializing the ``[b, np, sq, sk]`` score
matrix with ``baddbmm`` + softmax + ``bmm``, it calls torch's fused SDPA kernels (FlashAttention
2, memory-efficient attention or cuDNN on CUDA; Dao et al. 2022, "FlashAttention",
arXiv:2205.14135). It has no parameters, so the layer's parameter names (and the HF
conversion) are those of the local spec.

Which path a call takes (``attention_mask`` is Megatron's: bool, ``True`` = masked out):

=====================================  =============================================  ============
call                                   SDPA arguments                                  GQA
=====================================  =============================================  ============
mask None, causal, ``sq == sk``        ``is_causal=True`` (training, prefill)           ``enable_gqa``
mask None, causal, ``sq != sk``        ``causal_lower_right(sq, sk)``: query ``i`` is   ``enable_gqa``
(decode / chunked prefill vs a KV      position ``sk - sq + i`` (``is_causal=True``
cache)                                 would be top-left aligned: wrong there); for
                                       ``sq == 1`` that is "attend to every key"
mask None, ``no_mask``                 no mask (Megatron's decode steps set this)        ``enable_gqa``
explicit ``attention_mask``            ``attn_mask = ~attention_mask`` (padded batches,  KV repeated
                                       any ``[b or 1, 1, sq, sk]`` broadcastable mask)
=====================================  =============================================  ============

Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245): ``enable_gqa=True`` (torch >=
2.5) lets the kernel read each KV head for its query group, without the ``repeat_interleave``
copy that ``DotProductAttention`` makes. torch implements ``enable_gqa`` in its flash and math
kernels only; a masked call cannot use flash, so on that path the KV heads are repeated
explicitly, which keeps the memory-efficient kernel instead of the math fallback that would
materialize the scores.

Kernels in eval mode (rollout decoding, :mod:`mcore_rl.generation.megatron`): flash,
memory-efficient or math only, never cuDNN. torch's default picks cuDNN attention on Hopper,
which plans anew for every KV length (measured on an H200, torch 2.11: ~32 ms for the first
one-token call at a new length against 0.1 ms for flash, so decoding ran 2x slower than the
local spec) and whose output was not bitwise repeatable (the same seed gave other rollouts).
Training keeps torch's choice (cuDNN is the fastest training kernel there).

Fully masked query rows (for example left-padding rows): SDPA would return NaN for them (a
softmax over nothing) and a NaN at a padded position still poisons a masked loss (``0 * NaN``).
Such rows are unmasked instead (they attend to every key, a finite value nobody reads), as
Megatron's ``masked_fill(-10000)`` softmax also gives them a finite value.

Rollout decoding with a static KV cache (:class:`KVCache`, :func:`kv_cache_attention`): while the
``megatron`` rollout backend decodes (:mod:`mcore_rl.generation.megatron`), every layer's core
attention (of any spec: ``DotProductAttention`` or :class:`TorchSDPAttention`) is wrapped so that a
prefill forward stores its keys and values in the cache and a decode forward (one token per row,
each row at its own position) writes its key/value at that position and attends over the cache.
Megatron-Core's own KV caches do not fit there: its static-batching context keeps one sequence
offset for the whole batch (rows cannot sit at their own positions), its CUDA-graph decode path
needs flash-attn's ``flash_attn_with_kvcache`` ("CUDA graphs must use flash decode with static
batching", ``Attention.forward``), and its dynamic-batching context asserts flash-attn >= 2.7.3.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from mcore_rl.megatron import context_parallel

# Eval-mode (decoding) kernels: see the module docstring.
_INFERENCE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchSDPAttention(DotProductAttention):
    """Megatron core attention computed by ``torch.nn.functional.scaled_dot_product_attention``.

    Constructor: that of Megatron's ``DotProductAttention`` (``config, layer_number,
    attn_mask_type, attention_type, attention_dropout=None, softmax_scale=None,
    cp_comm_type=None, pg_collection=None``). The softmax scale is ``softmax_scale`` or
    ``1/sqrt(head_dim)`` (Vaswani et al. 2017, eq. 1); ``apply_query_key_layer_scaling`` only
    moves a factor between the score and the fp32 softmax in Megatron, so it does not change
    the scale here.

    Context parallelism (``config.context_parallel_size`` CP > 1): each rank holds two chunks of
    the sequence (Megatron's load-balanced layout) and attends them to the keys and values of
    every CP rank, all-gathered (Transformer Engine's ``cp_comm_type=all_gather`` method;
    :func:`mcore_rl.megatron.context_parallel.attention`), causal; packed micro-batches hold
    those two chunks of every sequence and attend within each sequence
    (:meth:`_context_parallel_packed`).

    Raises:
        ValueError: (at construction) a configuration SDPA does not reproduce here: sliding
            window attention (``config.window_size``) or a softmax type other than
            ``"vanilla"`` (attention sinks); use the ``local`` or ``transformer_engine`` spec.
    """

    def __init__(self, *args, **kwargs):
        config = kwargs["config"] if "config" in kwargs else args[0]
        if config.context_parallel_size > 1:
            # DotProductAttention asserts CP = 1 (its attention does not split); this one does
            # (:func:`~mcore_rl.megatron.context_parallel.attention`): build with a CP-1 copy.
            single = copy.copy(config)
            single.context_parallel_size = 1
            if "config" in kwargs:
                kwargs["config"] = single
            else:
                args = (single, *args[1:])
        super().__init__(*args, **kwargs)
        self.config = config
        if self.config.window_size is not None:
            raise ValueError("TorchSDPAttention (megatron.layer_spec=torch) does not support "
                             f"sliding-window attention (window_size={self.config.window_size})")
        if getattr(self.config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("TorchSDPAttention (megatron.layer_spec=torch) supports only "
                             f"softmax_type='vanilla', got {self.config.softmax_type!r}")
        if self.config.apply_query_key_layer_scaling:
            self.softmax_scale *= self.layer_number  # undo the split; SDPA scales once

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Attention of ``query`` over ``key``/``value``.

        Args:
            query: ``[sq, b, np, hn]`` (``np`` = this TP rank's query heads).
            key, value: ``[sk, b, ng, hn]`` (``ng`` = this rank's query groups, ``np % ng == 0``).
            attention_mask: None, or bool broadcastable to ``[b, 1, sq, sk]``, ``True`` = masked.
            attn_mask_type: overrides the module's type (Megatron passes ``no_mask`` on decode
                steps); ``causal``/``causal_bottom_right`` apply causal masking when no mask is
                given.
            attention_bias: unsupported (as in ``DotProductAttention``).
            packed_seq_params: Megatron's ``PackedSeqParams`` with ``qkv_format='thd'``: then
                ``query`` is ``[t, np, hn]``, ``key``/``value`` ``[t, ng, hn]`` (sequences
                concatenated) and the result is ``[t, np * hn]``
                (:func:`varlen_causal_attention`).

        Returns:
            ``[sq, b, np * hn]`` in the dtype of ``query``.

        Raises:
            ValueError: ``attention_bias`` given, ``packed_seq_params`` not in THD format (or
                with attention dropout in training), or an ``attention_mask`` that is not bool.
        """
        if attention_bias is not None:
            raise ValueError("TorchSDPAttention does not support attention_bias; use "
                             "megatron.layer_spec=transformer_engine")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError("TorchSDPAttention: packed_seq_params needs qkv_format='thd', "
                                 f"got {packed_seq_params.qkv_format!r}")
            if self.attention_dropout.p > 0.0 and self.training:
                raise ValueError("TorchSDPAttention: packed sequences do not support "
                                 "attention dropout")
            if self.config.context_parallel_size > 1:
                return self._context_parallel_packed(query, key, value, packed_seq_params)
            return varlen_causal_attention(query, key, value, packed_seq_params,
                                           self.softmax_scale)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, np_, hn = query.shape
        if self.config.context_parallel_size > 1:
            return self._context_parallel(query, key, value, attention_mask, mask_type)
        sk = key.shape[0]
        # [s, b, h, d] -> [b, h, s, d] views (SDPA needs only the last dim contiguous).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        gqa = np_ != key.shape[2]
        extra = {}
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError("TorchSDPAttention: attention_mask must be bool (True = masked), "
                                 f"got {attention_mask.dtype}")
            keep = ~attention_mask
            keep = keep | ~keep.any(dim=-1, keepdim=True)  # fully masked rows: see module doc
            extra["attn_mask"] = keep
            if gqa:
                k = k.repeat_interleave(np_ // k.shape[1], dim=1)
                v = v.repeat_interleave(np_ // v.shape[1], dim=1)
                gqa = False
        elif mask_type in (AttnMaskType.causal, AttnMaskType.causal_bottom_right):
            if sq == sk:
                extra["is_causal"] = True
            elif sq > 1:
                extra["attn_mask"] = causal_lower_right(sq, sk)
        elif mask_type != AttnMaskType.no_mask:
            raise ValueError(f"TorchSDPAttention: attn_mask_type {mask_type.name} needs an "
                             f"attention_mask")
        dropout = self.attention_dropout.p if self.training else 0.0
        if gqa:
            extra["enable_gqa"] = True
        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout,
                                                     scale=self.softmax_scale, **extra)
        elif not self.training:
            with sdpa_kernel(_INFERENCE_BACKENDS):
                out = F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale, **extra)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout,
                                                 scale=self.softmax_scale, **extra)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _cp_group(self):
        """The CP group: the attention's ``pg_collection.cp`` (Megatron's ``Attention`` passes
        one with ``tp`` and ``cp``), else Megatron's parallel state's."""
        group = getattr(self.pg_collection, "cp", None)
        if group is None:
            group = parallel_state.get_context_parallel_group()
        return group

    def _context_parallel(self, query, key, value, attention_mask, mask_type) -> torch.Tensor:
        """Causal attention of this CP rank's two sequence chunks (``query`` ``[2 c, b, np,
        hn]``) over the keys of every CP rank (:func:`mcore_rl.megatron.context_parallel.
        attention`). Raises ``ValueError`` for an explicit mask or a non-causal mask type."""
        if attention_mask is not None or mask_type not in (AttnMaskType.causal,
                                                           AttnMaskType.causal_bottom_right):
            raise ValueError("TorchSDPAttention with context_parallel_size > 1 computes causal "
                             "attention without an explicit mask only")
        sq, b, np_, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0
        rng = (tensor_parallel.get_cuda_rng_tracker().fork()
               if dropout > 0.0 and not self.config.sequence_parallel else contextlib.nullcontext())
        with rng:
            out = context_parallel.attention(q, k, v, self.softmax_scale, self._cp_group(),
                                             dropout_p=dropout)
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _context_parallel_packed(self, query, key, value, packed_seq_params) -> torch.Tensor:
        """Attention within each sequence of a packed micro-batch split over the CP ranks
        (``query`` ``[t, np, hn]``: this rank's two chunks of every sequence, :func:`mcore_rl.
        megatron.context_parallel.local_positions`): keys and values all-gathered into packed
        order (:func:`~mcore_rl.megatron.context_parallel.gather_sequence`, backward: summed
        back to their rank), each query attending causally to the keys of its own sequence
        (:func:`document_attention` at its packed position). Returns ``[t, np * hn]``."""
        group = self._cp_group()
        cp_size, rank = group.size(), group.rank()
        cu = _packed_cu_seqlens(packed_seq_params)
        total = query.shape[0] * cp_size
        k_all, v_all = (context_parallel.gather_sequence(t, group, cu) for t in (key, value))
        positions = context_parallel.local_positions(total, cp_size, rank, query.device, cu)
        return document_attention(query, k_all, v_all, cu, self.softmax_scale,
                                  packed_seq_params, query_positions=positions)


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of each token of a packed micro-batch.

    Args:
        cu_seqlens: ``[n + 1]`` int, cumulative sequence starts (``0, l_0, l_0 + l_1, ...``).
        total: tokens in the packed tensor (``>= cu_seqlens[-1]``); tokens past
            ``cu_seqlens[-1]`` (padding to a TP multiple) form one more sequence, index ``n``.

    Returns:
        ``[total]`` int64 on the device of ``cu_seqlens``.
    """
    cu = cu_seqlens.to(torch.long)
    pos = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:], pos, right=True)


_flex_compiled = None


def _flex_attention():
    """``torch.compile``-d ``flex_attention`` (compiled once per process; eager flex
    materializes the scores)."""
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        # dynamic=None: torch recompiles once with a symbolic length after the first change
        # (packed lengths differ between micro-batches).
        _flex_compiled = torch.compile(flex_attention)
    return _flex_compiled


def _torch_varlen():
    """``(varlen_attn, causal kwargs, has enable_gqa)`` of ``torch.nn.attention.varlen`` (FlashAttention
    varlen kernels in torch itself), or None when this torch lacks it. torch 2.10 takes
    ``is_causal=True``; later versions ``window_size=(-1, 0)``."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            packed_seq_params, scale: float) -> torch.Tensor:
    """Causal attention within each sequence of a packed (THD) micro-batch.

    Token ``i`` attends to token ``j`` when both are in the same sequence and ``j <= i``
    (a block-diagonal causal "document" mask); the tail past ``cu_seqlens_q[-1]`` (padding to a
    TP multiple) only attends within itself. On CUDA in bf16/fp16: torch's own varlen
    FlashAttention (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10) when present; else
    :func:`document_attention` (FlexAttention on CUDA, SDPA with a dense mask elsewhere).

    Args:
        query: ``[t, np, hn]``; key, value: ``[t, ng, hn]`` (``np % ng == 0``).
        packed_seq_params: Megatron ``PackedSeqParams`` (``cu_seqlens_q`` ``[n + 1]`` int32, on
            the host or the device: a host copy is moved once and cached on the object;
            ``cu_seqlens_q_padded`` is used instead when set, as Megatron's RoPE does).
        scale: softmax scale.

    Returns:
        ``[t, np * hn]`` in the dtype of ``query``.
    """
    t, np_, hn = query.shape
    cu = _packed_cu_seqlens(packed_seq_params)
    varlen = _torch_varlen() if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) \
        else None
    if varlen is not None:
        varlen_attn, causal, has_gqa = varlen
        k, v, extra = key, value, {}
        if np_ != key.shape[1]:
            if has_gqa:
                extra["enable_gqa"] = True
            else:
                k = k.repeat_interleave(np_ // k.shape[1], dim=1)
                v = v.repeat_interleave(np_ // v.shape[1], dim=1)
        if cu.device != query.device:  # a host cu_seqlens: copied once per micro-batch
            on_device = getattr(packed_seq_params, "_mcore_rl_cu_device", None)
            if on_device is None:
                on_device = cu.to(device=query.device, dtype=torch.int32, non_blocking=True)
                packed_seq_params._mcore_rl_cu_device = on_device
            cu = on_device
        longest = packed_seq_params.max_seqlen_q or int((cu[1:] - cu[:-1]).max())
        out = varlen_attn(query.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest,
                          longest, scale=scale, **causal, **extra)
        return out.reshape(t, np_ * hn)
    return document_attention(query, key, value, cu, scale, packed_seq_params)


def _packed_cu_seqlens(packed_seq_params) -> torch.Tensor:
    """The sequence starts attention and RoPE read: ``cu_seqlens_q_padded`` when set, else
    ``cu_seqlens_q`` (Megatron's rule)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q if cu is None else cu


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cu_seqlens: torch.Tensor, scale: float, packed_seq_params,
                       query_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of packed queries to the packed keys of their own sequence, causally:
    query ``i`` (packed position ``p_i``) attends to key ``j`` when both are in the same
    sequence of ``cu_seqlens`` and ``j <= p_i``.

    On CUDA: FlexAttention (``torch.nn.attention.flex_attention``, compiled; Dong et al. 2024,
    arXiv:2412.05496) with a block mask built once per micro-batch and cached on
    ``packed_seq_params`` (every layer reuses it), GQA without repeating KV heads. Elsewhere:
    SDPA with the dense ``[tq, tk]`` boolean mask (KV heads repeated), fine for CPU tests. No
    query row is fully masked: each sees its own key.

    Args:
        query: ``[tq, np, hn]``; key, value: ``[tk, ng, hn]``, every position of the packed
            row (``np % ng == 0``).
        cu_seqlens: ``[n + 1]`` int, sequence starts of the packed row (host or device); keys
            past ``cu_seqlens[-1]`` form one more sequence.
        scale: softmax scale.
        packed_seq_params: where the CUDA block mask is cached (any object with attributes).
        query_positions: ``[tq]`` int64, the packed position of each query (context
            parallelism: this rank's, :func:`mcore_rl.megatron.context_parallel.
            local_positions`); None: ``0 .. tq - 1`` (``tq == tk``).

    Returns:
        ``[tq, np * hn]`` in the dtype of ``query``.
    """
    tq, np_, hn = query.shape
    tk = key.shape[0]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, h, t, d]
    if query.is_cuda:
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = getattr(packed_seq_params, "_mcore_rl_block_mask", None)
        if block_mask is None or tuple(block_mask.shape[-2:]) != (tq, tk):
            doc = document_ids(cu_seqlens.to(query.device), tk)
            qpos = None if query_positions is None else query_positions.to(query.device)

            def causal_document(b, h, q_idx, kv_idx):
                p = q_idx if qpos is None else qpos[q_idx]
                return (doc[p] == doc[kv_idx]) & (kv_idx <= p)

            block_mask = create_block_mask(causal_document, None, None, tq, tk,
                                           device=query.device)
            packed_seq_params._mcore_rl_block_mask = block_mask
        out = _flex_attention()(q, k, v, block_mask=block_mask, scale=scale,
                                enable_gqa=np_ != key.shape[1])
    else:
        doc = document_ids(cu_seqlens, tk).to(query.device)
        pos = torch.arange(tk, device=query.device)
        qpos = pos[:tq] if query_positions is None else query_positions.to(query.device)
        keep = (doc[qpos][:, None] == doc[None, :]) & (pos[None, :] <= qpos[:, None])
        if np_ != key.shape[1]:
            k = k.repeat_interleave(np_ // k.shape[1], dim=1)
            v = v.repeat_interleave(np_ // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    return out[0].transpose(0, 1).reshape(tq, np_ * hn)


class KVCache:
    """Static key/value buffers of every attention layer of one model, for ``rows`` sequences of up
    to ``slots`` tokens each, and the mode of the next forward (set by the decoder before it).

    Buffers: ``keys[layer]`` and ``values[layer]`` ``[rows, groups, slots + 1, head_dim]`` (a spare
    slot at the end, never attended; groups and
    query heads of this tensor-parallel rank; keys after the rotary embedding), keyed by the
    attention's ``layer_number``. Row ``r``'s token at position ``p`` sits at ``[r, :, p]``.

    Modes (:meth:`prefill`, :meth:`decode`, :meth:`decode_shared`): see :class:`CachedAttention`.

    Shared prompts (``prompt_rows > 0``, ``generation.shared_prompt_kv``): the ``G`` rows of a
    prompt group read one copy of the prompt's keys and values. ``prompt_keys[layer]`` /
    ``prompt_values[layer]`` ``[prompt_rows, groups, prompt_slots, head_dim]`` hold group
    ``p``'s prompt at ``[p, :, i]`` (position ``i``); ``keys`` / ``values`` then hold each row's
    response only, response token ``j`` (position ``prompt length + j``) at ``[r, :, j]``; rows
    ``p * G .. p * G + G - 1`` are group ``p``'s.

    Args:
        attentions: the model's ``SelfAttention`` modules (their ``layer_number``,
            ``num_query_groups_per_partition``, ``key_hidden_size``, ``val_hidden_size``).
        rows, slots: buffer sizes.
        dtype, device: of the buffers (the model's ``params_dtype`` and device).
        prompt_rows, prompt_slots: sizes of the shared prompts' buffers (0: none).
    """

    def __init__(self, attentions, rows: int, slots: int, dtype: torch.dtype,
                 device: torch.device, prompt_rows: int = 0, prompt_slots: int = 0):
        self.rows, self.slots = rows, slots
        self.prompt_rows, self.prompt_slots = prompt_rows, prompt_slots
        self.keys: Dict[int, torch.Tensor] = {}
        self.values: Dict[int, torch.Tensor] = {}
        self.prompt_keys: Dict[int, torch.Tensor] = {}
        self.prompt_values: Dict[int, torch.Tensor] = {}
        for attn in attentions:
            for n, width, keys, values in ((rows, slots, self.keys, self.values),
                                           (prompt_rows, prompt_slots, self.prompt_keys,
                                            self.prompt_values)):
                if not n:
                    continue
                # one spare slot: no attended span covers a whole row, so a step's views of the
                # buffers are never contiguous, whatever the span (a compiled reader's strides
                # then do not depend on it: mcore_rl/megatron/decode_layer.py)
                shape = (n, attn.num_query_groups_per_partition, width + 1)
                keys[attn.layer_number] = torch.zeros(*shape, attn.key_hidden_size, dtype=dtype,
                                                      device=device)
                values[attn.layer_number] = torch.zeros(*shape, attn.val_hidden_size,
                                                        dtype=dtype, device=device)
        self._index = torch.arange(max(rows, slots, prompt_slots), device=device)
        self._prefill_rows: Optional[torch.Tensor] = None
        self._prefill_prompts = False
        self._positions: Optional[torch.Tensor] = None
        self._after: Optional[torch.Tensor] = None
        self._span = 0
        # decode_shared: each row's response index, the prompt span, rows per group
        self._response_index: Optional[torch.Tensor] = None
        self._prompt_span, self._group = 0, 0

    def prefill(self, rows: torch.Tensor, prompts: bool = False) -> None:
        """The next forward runs whole prompts from position 0 for the cache rows ``rows``
        (``[n]`` int64, the forward's batch order); rows of the shared prompts' buffers with
        ``prompts``."""
        self._prefill_rows, self._positions, self._prefill_prompts = rows, None, prompts

    def decode(self, positions: torch.Tensor, span: int) -> None:
        """The next forward runs one token for each of the cache rows ``0 .. B-1``, row ``r`` at
        position ``positions[r]`` (``[B]`` int64, a tensor the decoder updates in place: CUDA
        graphs replay on it); attention reads keys ``0 .. span-1`` (every position a row attends
        to, ``positions < span``, is inside). Computes the key mask of that forward's layers."""
        if not 0 < span <= self.slots:
            raise ValueError(f"KVCache.decode: span {span} outside [1, {self.slots}]")
        self._prefill_rows, self._positions, self._span = None, positions, span
        self._response_index = None
        self._after = self._index[:span] > positions[:, None]  # [B, span], True: after the row

    def decode_shared(self, positions: torch.Tensor, prompt_lengths: torch.Tensor,
                      prompt_span: int, span: int, group: int) -> None:
        """As :meth:`decode`, with the shared prompts' layout: row ``r`` (of group ``r //
        group``) at position ``positions[r]`` after a prompt of ``prompt_lengths[r]`` tokens
        (``[B]`` int64 each, updated in place by the decoder) writes its key and value at
        response index ``positions[r] - prompt_lengths[r]`` (clamped into the buffers: a row
        that ended steps on unread) and attends to its group's prompt keys ``< prompt_span``
        and its own response keys ``< span``. Computes that forward's key mask ``[B,
        prompt_span + span]`` (True: masked)."""
        if not (0 < span <= self.slots and 0 < prompt_span <= self.prompt_slots):
            raise ValueError(f"KVCache.decode_shared: spans {prompt_span}, {span} outside "
                             f"[1, {self.prompt_slots}], [1, {self.slots}]")
        self._prefill_rows, self._positions, self._span = None, positions, span
        self._prompt_span, self._group = prompt_span, group
        index = (positions - prompt_lengths).clamp_(0, self.slots - 1)
        self._response_index = index
        self._after = torch.cat((self._index[:prompt_span] >= prompt_lengths[:, None],
                                 self._index[:span] > index[:, None]), dim=1)

    def step(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Tuple:
        """In a decode mode: write layer ``layer``'s key and value ``[B, ng, d]`` of this step
        at each row's position (response index with shared prompts; :func:`write_kv` at
        :meth:`target`), and return what the attention reads (:meth:`read`)."""
        b = key.shape[0]
        write_kv(self.keys[layer], self.values[layer], *self.target(b), key, value)
        return self.read(layer, b)

    def target(self, b: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """In a decode mode: where rows ``0 .. b-1`` write this step's keys and values,
        ``(cache rows, slots)``, ``[b]`` int64 each on the cache's device (``arange(b)`` and
        the rows' positions, or response indices with shared prompts): the indices of
        :func:`write_kv` (a compiled caller fuses the write into the kernel that computes the
        key: :mod:`mcore_rl.megatron.decode_layer`)."""
        at = self._response_index if self._response_index is not None else self._positions
        return self._index[:b], at

    def read(self, layer: int, b: int) -> Tuple:
        """In a decode mode, after this step's write: what the attention of rows ``0 .. b-1``
        reads (:func:`cache_attention`): ``(keys, values, mask, prompt_keys, prompt_values)``,
        the rows' keys and values ``[b, ng, span, d]`` (views of the buffers), the key mask
        ``[b, span]`` (``[b, prompt span + span]`` with shared prompts; True: masked), and the
        groups' prompt keys and values ``[b / G, ng, prompt span, d]`` (None without shared
        prompts)."""
        keys = self.keys[layer][:b, :, :self._span]
        values = self.values[layer][:b, :, :self._span]
        if self._response_index is None:
            return keys, values, self._after, None, None
        groups, span = b // self._group, self._prompt_span
        return (keys, values, self._after, self.prompt_keys[layer][:groups, :, :span],
                self.prompt_values[layer][:groups, :, :span])

    def keep_rows(self, index: torch.Tensor, prompts: bool = False) -> None:
        """Keep the rows ``index`` (``[m]`` int64), moved to rows ``0 .. m-1`` (batch
        compaction); of the shared prompts' buffers with ``prompts``."""
        m = index.numel()
        for buffers in ((self.prompt_keys, self.prompt_values) if prompts
                        else (self.keys, self.values)):
            for t in buffers.values():
                t[:m] = t[index]


def write_kv(keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, at: torch.Tensor,
             key: torch.Tensor, value: torch.Tensor) -> None:
    """Write one decode step's ``key`` and ``value`` ``[B, ng, d]`` into a layer's cache
    buffers ``keys`` / ``values`` ``[R, ng, S, d]``: row ``i``'s at ``[rows[i], :, at[i]]``
    (``rows``, ``at``: ``[B]`` int64, in range; the indices of :meth:`KVCache.target`). One
    indexed write each (``index_put_``); a write copies values, so any form of it is bit for
    bit the same cache. Inside ``torch.compile`` (:mod:`mcore_rl.megatron.decode_layer`)
    Inductor lowers both writes into the kernel that computes the key's RoPE (one
    scatter-store loop over ``[B, ng, d]``, in place: no copy of the buffers)."""
    keys[rows, :, at] = key
    values[rows, :, at] = value


class CachedAttention(torch.nn.Module):
    """A layer's core attention ``core`` with the KV cache ``cache`` around it (no parameters).

    Prefill mode (:meth:`KVCache.prefill`): ``core`` computes the attention of the ``[s, n]``
    prompts as in training (causal, right padding: a valid token never sees a later pad), and the
    keys and values of positions ``0 .. s-1`` are stored in the rows given. Decode mode
    (:meth:`KVCache.decode`): the one query of each row attends over the row's cached keys at
    positions ``<=`` its own, after its key and value are written at its position
    (:func:`decode_attention`).

    Forward: Megatron's core-attention signature (``query [sq, b, np, hn]``, ``key``/``value``
    ``[sq, b, ng, hn]``, ``attention_mask``, ``attn_mask_type``, ``attention_bias``,
    ``packed_seq_params``) -> ``[sq, b, np * hn]``.

    Raises:
        ValueError: (at construction) ``apply_query_key_layer_scaling`` (the decode path takes the
            softmax scale as one number).
    """

    def __init__(self, core: torch.nn.Module, cache: KVCache, layer_number: int):
        super().__init__()
        if core.config.apply_query_key_layer_scaling:
            raise ValueError("KV-cache decoding does not support apply_query_key_layer_scaling")
        self.core, self.cache, self.layer_number = core, cache, layer_number

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        cache, layer = self.cache, self.layer_number
        keys, values = cache.keys[layer], cache.values[layer]
        if cache._prefill_rows is not None:
            if cache._prefill_prompts:
                keys, values = cache.prompt_keys[layer], cache.prompt_values[layer]
            s, rows = key.shape[0], cache._prefill_rows
            keys[:, :, :s].index_copy_(0, rows, key.permute(1, 2, 0, 3))
            values[:, :, :s].index_copy_(0, rows, value.permute(1, 2, 0, 3))
            return self.core(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                             attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        return cache_attention(query, cache.step(layer, key[0], value[0]), self.core.softmax_scale)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     attention_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query per row over that row's cached keys.

    Grouped-query attention (Ainslie et al. 2023) without repeating the KV heads: the ``np / ng``
    query heads of a group (Megatron's head order: head ``h`` is in group ``h // (np / ng)``) form
    the rows of one batched matrix product with that group's keys, so each key is read once.
    Scores in the input dtype, scaled in the product's fp32 accumulator (``baddbmm``'s ``alpha``,
    as Megatron's ``DotProductAttention``); softmax computed in fp32 and written in the input
    dtype by one kernel (the same numbers as Megatron's fp32 softmax and cast). Four kernels: a
    decode step of a small model is a string of small launches (bench/RESULTS.md), and scaling
    the query, then casting the probabilities, were two more per layer.

    Args:
        query: ``[1, B, np, hn]``.
        keys, values: ``[B, ng, S, hn]`` (a row's positions ``0 .. S-1``).
        attention_mask: ``[B, S]`` bool, ``True`` = masked out (keys after the row's position);
            every row keeps at least one key.
        scale: softmax scale (``1/sqrt(hn)`` unless configured).

    Returns:
        ``[1, B, np * hn]`` in the dtype of ``query``.
    """
    b, ng, s, hn = keys.shape
    np_ = query.shape[2]
    q = query[0].reshape(b * ng, np_ // ng, hn)
    k = keys.reshape(b * ng, s, hn).transpose(1, 2)  # a view: rows and groups are adjacent
    scores = torch.baddbmm(q.new_empty(b * ng, np_ // ng, s), q, k, beta=0.0, alpha=scale)
    scores = scores.view(b, ng, np_ // ng, s).masked_fill_(attention_mask[:, None, None, :],
                                                           float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b * ng, np_ // ng, s)
    return torch.bmm(probs, values.reshape(b * ng, s, hn)).reshape(1, b, np_ * hn)


def flex_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          attention_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`decode_attention` as one fused attention (``generation.decode_attention=flex``):
    torch's FlexAttention (``torch.nn.attention.flex_attention``) computes the scores, the mask,
    the softmax and the weighted sum of the values in one kernel that keeps the scores in
    registers and the softmax online (FlashAttention, Dao et al. 2022, arXiv:2205.14135;
    split over the keys for short queries: Flash-Decoding, Dao, Haziza, Massa, Sizov 2023).
    Inside ``torch.compile`` Inductor generates that kernel (Triton on GPU, a C++ template on
    CPU); called eagerly, FlexAttention computes the same attention unfused (the tests' check).

    Grouped-query attention as :func:`decode_attention` arranges it: the ``np / ng`` query heads
    of KV group ``g`` (Megatron's head order) are the ``np / ng`` queries of FlexAttention's head
    ``g``, so the attention has ``ng`` heads on both sides and no ``enable_gqa`` (the same
    numbers). The reason is the GPU kernel: Inductor (torch 2.13's ``_use_flex_decoding``) takes
    its decoding (split-KV) kernel only for static batch and head counts, a query length under
    128 and, with ``enable_gqa``, a power-of-two number of query heads per KV head
    (SmolLM2-135M has 3), else the main FlexAttention kernel; hence also the static rows of
    :class:`~mcore_rl.megatron.decode_layer.DecodeLayers` with ``flex``. The mask is a
    ``score_mod`` that reads ``attention_mask`` (``-inf`` where True): no block mask is built per
    call; FlexAttention visits every key block up to the span.

    Not bit for bit :func:`decode_attention`: the kernel keeps the scores and the softmax in
    fp32 and rounds once, at the output (as FlashAttention, which the training forward uses
    through SDPA), where :func:`decode_attention` rounds the scores and the probabilities to
    the input dtype; and it sums in another order. Bound: fp32 on CPU within 1e-5 of
    :func:`decode_attention` per output element, and the decoder's rollouts equal
    (``tests/test_flex_decode.py``); bf16 on the GPU: ``scripts/gpu/decode_step_profile.py``'s
    ``compile+flex`` variant against ``compile``.

    Args:
        query: ``[1, B, np, hn]``.
        keys, values: ``[B, ng, S, hn]`` (a row's positions ``0 .. S-1``; the last dim
            contiguous, views of the cache buffers are fine).
        attention_mask: ``[B, S]`` bool, ``True`` = masked out; every row keeps at least one
            key (a row with none would give NaN).
        scale: softmax scale.

    Returns:
        ``[1, B, np * hn]`` in the dtype of ``query``.
    """
    from torch.nn.attention.flex_attention import flex_attention

    b, ng, _, hn = keys.shape
    q = query[0].view(b, ng, query.shape[2] // ng, hn)  # a group's query heads as its queries

    def masked(score, row, head, q_idx, kv_idx):
        return torch.where(attention_mask[row, kv_idx], float("-inf"), score)

    out = flex_attention(q, keys, values, score_mod=masked, scale=scale)
    return out.reshape(1, b, query.shape[2] * hn).to(query.dtype)


def cache_attention(query: torch.Tensor, kv: Tuple, scale: float, attention: str = "bmm"
                    ) -> torch.Tensor:
    """The decode attention of ``query`` ``[1, B, np, d]`` over what :meth:`KVCache.step`
    returned, by ``attention`` (``generation.decode_attention``): ``bmm``,
    :func:`decode_attention` over the rows' keys up to the span, or with shared prompts
    :func:`shared_decode_attention`; ``flex``, :func:`flex_decode_attention` (``triton`` is
    :mod:`mcore_rl.megatron.decode_layer`'s call of
    :func:`mcore_rl.megatron.flash_decode.flash_decode`). Returns ``[1, B, np * d]``.

    Raises:
        NotImplementedError: ``flex`` with shared prompts (refused at load:
            ``generation.decode_attention=flex`` with ``generation.shared_prompt_kv``).
    """
    keys, values, mask, prompt_keys, prompt_values = kv
    if prompt_keys is None:
        attend = flex_decode_attention if attention == "flex" else decode_attention
        return attend(query, keys, values, mask, scale)
    if attention == "flex":
        raise NotImplementedError("generation.decode_attention=flex does not support "
                                  "generation.shared_prompt_kv")
    return shared_decode_attention(query, prompt_keys, prompt_values, keys, values, mask, scale)


def shared_decode_attention(query: torch.Tensor, prompt_keys: torch.Tensor,
                            prompt_values: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            attention_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`decode_attention` of rows in groups that share their prompt: the ``G`` rows of
    group ``p`` (rows ``p * G .. p * G + G - 1``) attend to the group's one copy of the prompt's
    keys and values and to their own response keys and values; a two-level attention (prompt
    part + per-row part, as split-KV / flash-decoding splits the keys), combined by one softmax
    over the two parts' scores side by side.

    The prompt part is one batched product per (group, KV head) with the ``G * np / ng`` query
    heads of the group's rows as its rows, so each prompt key and value is read once for the
    group instead of ``G`` times. Scores in the input dtype with the scale in the fp32
    accumulator, the softmax in fp32 written in the input dtype, as :func:`decode_attention`.

    Against the rows decoded alone (:func:`decode_attention` over the prompt and the response
    in one row of the cache), the scores are the same dot products, but the softmax sums its
    terms in another arrangement (the prompt's padding between the two parts) and the output is
    the prompt part's product plus the response part's, each rounded to the input dtype, where
    one product summed both: not bit for bit. Bound: a few units in the last place of the input
    dtype per output element per layer (fp32 on CPU: rollouts equal and logprobs within 1e-5 of
    the unshared decoder, ``tests/test_megatron_generation.py``; bf16 on the GPU: measured by
    ``scripts/gpu/decode_step_profile.py``, its ``shared`` variant against ``base``).

    Args:
        query: ``[1, B, np, hn]``, ``B = P * G``.
        prompt_keys, prompt_values: ``[P, ng, Sp, hn]`` (group ``p``'s prompt positions
            ``0 .. Sp-1``).
        keys, values: ``[B, ng, Sr, hn]`` (row ``r``'s response tokens ``0 .. Sr-1``).
        attention_mask: ``[B, Sp + Sr]`` bool, ``True`` = masked out (prompt padding, response
            tokens after the row's); every row keeps at least one key.
        scale: softmax scale.

    Returns:
        ``[1, B, np * hn]`` in the dtype of ``query``.
    """
    b, ng, sr, hn = keys.shape
    p, sp = prompt_keys.shape[0], prompt_keys.shape[2]
    g, nq = b // p, query.shape[2] // ng
    q = query[0].view(p, g, ng, nq, hn)
    # prompt part: [P * ng, G * nq, hn] queries of a group against its keys [P * ng, hn, Sp]
    qp = q.transpose(1, 2).reshape(p * ng, g * nq, hn)
    kp = prompt_keys.reshape(p * ng, sp, hn).transpose(1, 2)
    scores_p = torch.baddbmm(qp.new_empty(p * ng, g * nq, sp), qp, kp, beta=0.0, alpha=scale)
    # response part: [B * ng, nq, hn] against each row's own keys [B * ng, hn, Sr]
    qr = query[0].reshape(b * ng, nq, hn)
    kr = keys.reshape(b * ng, sr, hn).transpose(1, 2)
    scores_r = torch.baddbmm(qr.new_empty(b * ng, nq, sr), qr, kr, beta=0.0, alpha=scale)
    scores = torch.cat((scores_p.view(p, ng, g, nq, sp).transpose(1, 2),
                        scores_r.view(p, g, ng, nq, sr)), dim=-1)  # [P, G, ng, nq, Sp + Sr]
    scores.masked_fill_(attention_mask.view(p, g, 1, 1, sp + sr), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs_p = probs[..., :sp].transpose(1, 2).reshape(p * ng, g * nq, sp)
    out_p = torch.bmm(probs_p, prompt_values.reshape(p * ng, sp, hn))
    out_r = torch.bmm(probs[..., sp:].reshape(b * ng, nq, sr), values.reshape(b * ng, sr, hn))
    out = out_p.view(p, ng, g, nq, hn).transpose(1, 2) + out_r.view(p, g, ng, nq, hn)
    return out.reshape(1, b, ng * nq * hn)


@contextlib.contextmanager
def kv_cache_attention(attentions, cache: KVCache) -> Iterator[None]:
    """Every attention module of ``attentions`` (Megatron ``SelfAttention``) computes its core
    attention through :class:`CachedAttention` on ``cache`` inside the block; the original core
    attention modules are put back afterwards, also on an exception."""
    originals: Tuple[torch.nn.Module, ...] = tuple(a.core_attention for a in attentions)
    try:
        for attn, core in zip(attentions, originals):
            attn.core_attention = CachedAttention(core, cache, attn.layer_number)
        yield
    finally:
        for attn, core in zip(attentions, originals):
            attn.core_attention = core
