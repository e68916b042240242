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
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

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

    Raises:
        ValueError: (at construction) a configuration SDPA does not reproduce here: sliding
            window attention (``config.window_size``) or a softmax type other than
            ``"vanilla"`` (attention sinks); use the ``local`` or ``transformer_engine`` spec.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
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
            attention_bias, packed_seq_params: unsupported (as in ``DotProductAttention``).

        Returns:
            ``[sq, b, np * hn]`` in the dtype of ``query``.

        Raises:
            ValueError: ``attention_bias`` or ``packed_seq_params`` given, or an
                ``attention_mask`` that is not bool.
        """
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("TorchSDPAttention does not support attention_bias or packed "
                             "sequences (packed_seq_params); use megatron.layer_spec="
                             "transformer_engine")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, np_, hn = query.shape
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
