"""A transformer layer's decode step (one token per row against the KV cache) as two functions
of tensors, so that one ``torch.compile`` (Inductor) serves every layer and every CUDA-graph
bucket of the rollout decoder (``generation.compile_decode``; docs/design.md, "Generation
backends").

Why not compile Megatron's ``TransformerLayer`` itself: its forward reads module attributes
that differ between layers (the KV cache of its ``layer_number``), on which torch.compile
specializes, so it would compile once per layer (30 for SmolLM2-135M, over its recompile
limit), and again per row bucket and attended span. Here a layer is

- :func:`attention_in`: the previous layer's MLP residual add (none for the first layer), input
  RMSNorm, the QKV projection (+ bias), the split into query / key / value heads, the query and
  key RMSNorms (``qk_layernorm``), RoPE, and the KV-cache write
  (:func:`~mcore_rl.megatron.attention.write_kv` into the layer's buffers, passed in: Inductor
  stores the rotated key and the value at their cache slots from the kernel that computes
  them, in place, where the eager write was two ``index_put`` kernels a layer after it);
- :func:`attention_out`: the decode attention over the cache
  (:func:`~mcore_rl.megatron.attention.cache_attention`), the output projection (+ bias), the
  residual add, the pre-MLP RMSNorm, the SwiGLU MLP (+ biases), whose output it returns
  beside the residual stream: the MLP's residual add is the next layer's (in
  :func:`attention_in`) or, after the last layer, :class:`DecodeLayers`' (one eager add);

each taking the layer's weights as arguments (:class:`LayerWeights`, read from Megatron's
modules in place: nothing is copied) and the layer's constants (:class:`LayerShape`, the same
for every layer) as keywords. The row and span dimensions are marked dynamic
(``torch._dynamo.maybe_mark_dynamic``), so a compile is made once per function and KV layout
(twice for :func:`attention_in`: the first layer's, without a previous MLP output to add, and
the others');
with ``generation.decode_attention=triton`` the attention is one fused Triton kernel
(:func:`~mcore_rl.megatron.flash_decode.flash_decode`, an op torch.compile calls as it is);
with ``triton_rope`` that kernel also takes over the query and key RoPE and the KV-cache write
(:func:`~mcore_rl.megatron.flash_decode.flash_decode_rope`, called between the compiled
:func:`attention_in`, which then stops at the QKV projection, and :func:`projection_mlp`, the
rest of :func:`attention_out`: two kernels a layer fewer);
with ``generation.decode_attention=flex`` (FlexAttention,
:func:`~mcore_rl.megatron.attention.flex_decode_attention`) :func:`attention_out` keeps its
rows static, one compile per row bucket (:class:`DecodeLayers`).

Eager, the functions compute what Megatron-Core's layer computes, op for op (``torch.matmul``
with the transposed weight then ``+ bias``, as its linear layers; ``rms_norm`` as
``torch.nn.RMSNorm``; the unfused bias-dropout-add in eval, ``residual + (x + bias)``; the
unfused GLU, ``silu(gate) * (up + glu_linear_offset)``; RoPE as
:func:`mcore_rl.megatron.rope.rotate`): bit for bit (tests). Compiled, Inductor fuses the
elementwise work between the matrix products (norms, bias and residual adds, RoPE, SwiGLU,
the attention's mask and softmax) into a few kernels, whose intermediate rounding differs from
the eager ops': the bound is stated and tested where it is used. Each residual add is fused
with the RMSNorm after it (the pre-MLP one, or the next layer's input one), not taken into the
matrix product before it: written so that Inductor's ``addmm`` pattern does not match it (on
CUDA a copy of the residual before the GEMM; :func:`attention_out` says how and why).

Supported: dense layers of the ``local`` / ``torch`` specs (RMSNorm, SwiGLU, RoPE with
non-interleaved halves, optional QKV bias and QK RMSNorm) at tensor parallelism 1; anything
else raises ``NotImplementedError`` naming it (:func:`layer_weights`), and the decoder keeps
Megatron's layers.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from mcore_rl.config.schema import DECODE_ATTENTIONS
from mcore_rl.megatron.attention import cache_attention, write_kv
from mcore_rl.megatron.flash_decode import flash_decode, flash_decode_rope
from mcore_rl.megatron.rope import rotate_with


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """Constants of a layer's decode step (equal for every layer of a model; baked into the
    compiled functions).

    Attributes:
        heads, groups, head_dim: query heads, KV groups and head size of this rank.
        eps: the input and pre-MLP RMSNorms' epsilon.
        qk_eps: the query / key RMSNorms' epsilon, or None without ``qk_layernorm``.
        glu_offset: Megatron's ``glu_linear_offset`` (``up + offset`` in the GLU; 0.0).
        scale: the attention's softmax scale.
        attention: the decode attention over the cache (``generation.decode_attention``):
            ``bmm`` (:func:`~mcore_rl.megatron.attention.decode_attention`), ``flex``
            (:func:`~mcore_rl.megatron.attention.flex_decode_attention`), ``triton``
            (:func:`~mcore_rl.megatron.flash_decode.flash_decode`) or ``triton_rope``
            (:func:`~mcore_rl.megatron.flash_decode.flash_decode_rope`); set by
            :class:`DecodeLayers`, not read from the layer.
    """

    heads: int
    groups: int
    head_dim: int
    eps: float
    qk_eps: Optional[float]
    glu_offset: float
    scale: float
    attention: str = "bmm"


class LayerWeights(NamedTuple):
    """One layer's parameters, in place (Megatron's tensors, not copies): RMSNorm weights
    ``ln1``, ``ln2`` ``[h]``; ``qkv`` ``[ng (np/ng + 2) d, h]`` and its bias or None; ``q_ln``,
    ``k_ln`` ``[d]`` or None; ``proj`` ``[h, np d]`` and bias; ``fc1`` ``[2 f, h]`` (gate, then
    up) and bias; ``fc2`` ``[h, f]`` and bias."""

    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    q_ln: Optional[torch.Tensor]
    k_ln: Optional[torch.Tensor]
    proj: torch.Tensor
    proj_bias: Optional[torch.Tensor]
    ln2: torch.Tensor
    fc1: torch.Tensor
    fc1_bias: Optional[torch.Tensor]
    fc2: torch.Tensor
    fc2_bias: Optional[torch.Tensor]


def _linear_bias(module) -> Optional[torch.Tensor]:
    """The bias Megatron adds after a parallel linear layer's product: its ``bias`` (added in
    the layer, or by the caller when ``skip_bias_add``); None without one."""
    return getattr(module, "bias", None)


def _norm_or_none(module):
    """A q/k norm module, or None for none (Megatron's ``IdentityOp`` without qk_layernorm)."""
    from megatron.core.transformer.identity_op import IdentityOp

    return None if module is None or isinstance(module, IdentityOp) else module


def layer_weights(layer) -> Tuple[LayerShape, LayerWeights]:
    """The decode-step constants and weights of a Megatron ``TransformerLayer``.

    Raises:
        NotImplementedError: a layer these functions do not compute as Megatron does, named:
            tensor parallelism > 1, norms other than ``torch.nn.RMSNorm``, an MoE or non-GLU /
            non-SiLU MLP, GLU clamping, an attention output gate, interleaved or fused RoPE,
            YaRN scaling, a residual in fp32, or a QKV layer that drops its bias.
    """
    config = layer.config
    attn, mlp = layer.self_attention, layer.mlp
    problems = []
    if getattr(config, "tensor_model_parallel_size", 1) != 1:
        problems.append("tensor_model_parallel_size > 1")
    norms = [layer.input_layernorm, layer.pre_mlp_layernorm]
    qk = [_norm_or_none(getattr(attn, "q_layernorm", None)),
          _norm_or_none(getattr(attn, "k_layernorm", None))]
    if not all(isinstance(n, torch.nn.RMSNorm) for n in norms + [n for n in qk if n is not None]):
        problems.append("norms other than torch.nn.RMSNorm (the local and torch specs')")
    if (qk[0] is None) != (qk[1] is None):
        problems.append("a query norm without a key norm")
    if not hasattr(mlp, "linear_fc1") or getattr(layer, "is_moe_layer", False):
        problems.append("an MoE MLP")
    elif not (config.gated_linear_unit and config.activation_func is F.silu):
        problems.append("an MLP other than SwiGLU")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        problems.append("activation_func_clamp_value")
    if getattr(config, "attention_output_gate", False):
        problems.append("attention_output_gate")
    if config.rotary_interleaved or config.apply_rope_fusion or \
            getattr(config, "multi_latent_attention", False):
        problems.append("interleaved, fused or multi-latent RoPE")
    if getattr(config, "rope_type", None) == "yarn" or getattr(config, "no_rope_freq", None):
        problems.append("YaRN or no-RoPE layers")
    if config.fp32_residual_connection:
        problems.append("fp32_residual_connection")
    if getattr(attn.linear_qkv, "skip_bias_add", False) and _linear_bias(attn.linear_qkv) is not None:
        problems.append("a QKV layer with skip_bias_add (Megatron drops that bias)")
    if problems:
        raise NotImplementedError("compiled decode layers do not support " + ", ".join(problems))
    shape = LayerShape(
        heads=attn.num_attention_heads_per_partition,
        groups=attn.num_query_groups_per_partition,
        head_dim=attn.hidden_size_per_attention_head,
        eps=float(layer.input_layernorm.eps),
        qk_eps=None if qk[0] is None else float(qk[0].eps),
        glu_offset=float(getattr(config, "glu_linear_offset", 0.0) or 0.0),
        scale=float(attn.core_attention.softmax_scale))
    if float(layer.pre_mlp_layernorm.eps) != shape.eps or \
            (qk[1] is not None and float(qk[1].eps) != shape.qk_eps):
        raise NotImplementedError("compiled decode layers need one epsilon for both norms")
    weights = LayerWeights(
        ln1=layer.input_layernorm.weight, qkv=attn.linear_qkv.weight,
        qkv_bias=_linear_bias(attn.linear_qkv),
        q_ln=None if qk[0] is None else qk[0].weight, k_ln=None if qk[1] is None else qk[1].weight,
        proj=attn.linear_proj.weight, proj_bias=_linear_bias(attn.linear_proj),
        ln2=layer.pre_mlp_layernorm.weight, fc1=mlp.linear_fc1.weight,
        fc1_bias=_linear_bias(mlp.linear_fc1), fc2=mlp.linear_fc2.weight,
        fc2_bias=_linear_bias(mlp.linear_fc2))
    return shape, weights


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Megatron's parallel linear layer at TP=1: ``matmul(x, weight.t())`` then ``+ bias``."""
    out = torch.matmul(x, weight.t())
    return out if bias is None else out + bias


def attention_in(residual: torch.Tensor, delta: Optional[torch.Tensor], w: LayerWeights,
                 cos: torch.Tensor, signed_sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, rows: torch.Tensor, at: torch.Tensor, *,
                 shape: LayerShape) -> Tuple[torch.Tensor, torch.Tensor]:
    """The layer's input (the previous layer's MLP residual add) and the attention's inputs of
    one decode step (the one-token sequence dimension of Megatron's ``[1, B, ...]`` tensors
    dropped: the same products), the key and value written into the layer's KV cache
    (:func:`~mcore_rl.megatron.attention.write_kv`; compiled, the write is part of the kernel
    that computes the key's RoPE instead of two indexed writes after it).

    Args:
        residual: ``[B, h]`` the previous layer's residual stream after its attention (its
            :func:`attention_out`'s ``hidden``), or the first layer's input.
        delta: ``[B, h]`` the previous layer's MLP output (:func:`attention_out`'s
            ``mlp_out``), added to ``residual`` here (compiled: in the input RMSNorm's kernel),
            or None for the first layer (``residual`` is then the layer's input).
        w: the layer's weights.
        cos, signed_sin: ``[B, 1, d_rot]`` in ``hidden``'s dtype, each row's RoPE cosine and
            sine with its first half negated (:func:`mcore_rl.megatron.rope.cos_sin`).
        keys, values: the layer's cache buffers ``[R, ng, S, d]`` (written in place).
        rows, at: ``[B]`` int64, where each row's key and value go
            (:meth:`~mcore_rl.megatron.attention.KVCache.target`).
        shape: the layer's constants.

    Returns:
        ``(hidden [B, h], query [B, np, d])``: the layer's input ``residual + delta``
        (``residual`` itself without a delta), the residual of :func:`attention_out`; the
        query, RoPE applied (the key too, before its write). With ``shape.attention ==
        "triton_rope"`` the projection's output ``[B, ng, (np / ng + 2) d]`` instead of the
        query, nothing rotated or written: :func:`~mcore_rl.megatron.flash_decode.
        flash_decode_rope` does both in its kernel.
    """
    # The previous layer's bias-dropout-add, as Megatron's: the product (+ bias), rounded,
    # then + residual (here rather than in that layer's attention_out: see attention_out).
    hidden = residual if delta is None else residual + delta
    x = F.rms_norm(hidden, (hidden.shape[-1],), w.ln1, shape.eps)
    mixed = _linear(x, w.qkv, w.qkv_bias)
    per_group = shape.heads // shape.groups
    d = shape.head_dim
    mixed = mixed.view(mixed.shape[0], shape.groups, (per_group + 2) * d)
    if shape.attention == "triton_rope":  # RoPE and the cache write in the attention's kernel
        return hidden, mixed
    query, key, value = torch.split(mixed, [per_group * d, d, d], dim=2)
    query = query.reshape(query.size(0), -1, d)
    if w.q_ln is not None:
        query = F.rms_norm(query, (d,), w.q_ln, shape.qk_eps)
        key = F.rms_norm(key, (d,), w.k_ln, shape.qk_eps)
    write_kv(keys, values, rows, at, rotate_with(key, cos, signed_sin), value)
    return hidden, rotate_with(query, cos, signed_sin)


def attention_out(hidden: torch.Tensor, query: torch.Tensor, kv: Tuple, w: LayerWeights, *,
                  shape: LayerShape) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rest of the layer: attention over the cache, output projection, residual, MLP; the
    MLP's residual add is left to the next layer's :func:`attention_in` (or, after the last
    layer, to :class:`DecodeLayers`).

    Why the residual adds are written so (compiled; eager, the values are the same): Inductor's
    post-grad pattern ``addmm`` (``torch/_inductor/fx_passes/post_grad.py``, function ``addmm``,
    checked by ``is_valid_addmm_fusion`` / ``should_prefer_unfused_addmm``) rewrites
    ``add(residual, aten.mm(x, W))`` into ``aten.addmm(residual, x, W)`` whenever the sum has a
    user that is not pointwise (an RMSNorm's reduction, or the graph's output), and CUDA's
    ``addmm`` copies ``residual`` into its output before the GEMM (a device-to-device memcpy,
    two a layer). So

    - the MLP's sum is not formed here: ``mlp_out`` is returned, and the next layer's
      :func:`attention_in` adds it in its input RMSNorm's kernel;
    - the attention's product is computed on ``[1, B, np d]`` (Megatron's ``[s, b, h]``
      layout): ``torch.matmul`` of a 3-d input is an ``aten.mm`` of its ``[B, np d]`` view
      viewed back to ``[1, B, h]``, so the add's operand is that view, not a bare ``aten.mm``,
      and the pattern does not match; the add is fused with the pre-MLP RMSNorm.

    The unfused form rounds as Megatron's eager layer does (the product, rounded, then
    bias-dropout-add), where ``addmm`` rounds once.

    Args:
        hidden: ``[B, h]`` the layer's input (the residual), :func:`attention_in`'s.
        query: ``[B, np, d]`` from :func:`attention_in` (or ``[B, ng, np / ng, d]``, the
            same grouped: :class:`DecodeLayers` passes that with ``flex``).
        kv: the cache's buffers and mask of this step (:meth:`~mcore_rl.megatron.attention.
            KVCache.read`), for :func:`~mcore_rl.megatron.attention.cache_attention` (or
            :func:`~mcore_rl.megatron.flash_decode.flash_decode` with ``triton``).
        w, shape: the layer's weights and constants.

    Returns:
        ``(hidden [B, h], mlp_out [B, h])``: the residual stream after the attention's residual
        add, and the MLP's output (``fc2``'s product, + bias); the layer's output is their sum.
    """
    query = query.flatten(1, -2)  # [B, np, d]
    if shape.attention == "triton":
        keys, values, mask, prompt_keys, prompt_values = kv
        core = flash_decode(query, keys, values, mask, shape.scale, prompt_keys,
                            prompt_values).flatten(1)[None]
    else:
        core = cache_attention(query[None], kv, shape.scale, shape.attention)
    return projection_mlp(hidden, core, w, shape=shape)


def projection_mlp(hidden: torch.Tensor, core: torch.Tensor, w: LayerWeights, *,
                   shape: LayerShape) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_out` after the attention: the output projection (+ bias), the
    residual add, the pre-MLP RMSNorm and the SwiGLU MLP (+ biases).

    Args:
        hidden: ``[B, h]`` the layer's input (the residual).
        core: ``[1, B, np d]`` the attention's output (Megatron's ``[s, b, h]`` layout, which
            keeps the residual add out of Inductor's ``addmm``: :func:`attention_out`).
        w, shape: the layer's weights and constants.

    Returns:
        ``(hidden [B, h], mlp_out [B, h])`` as :func:`attention_out`.
    """
    # [1, B, np d] @ [np d, h]: not a bare aten.mm for Inductor's addmm pattern (attention_out)
    hidden = (hidden[None] + _linear(core, w.proj, w.proj_bias))[0]
    x = F.rms_norm(hidden, (hidden.shape[-1],), w.ln2, shape.eps)
    gate, up = torch.chunk(_linear(x, w.fc1, w.fc1_bias), 2, dim=-1)
    return hidden, _linear(F.silu(gate) * (up + shape.glu_offset), w.fc2, w.fc2_bias)


class DecodeLayers:
    """The decode step of a model's layers through :func:`attention_in` /
    :func:`attention_out` (module docstring).

    Args:
        layers: Megatron's ``TransformerLayer`` modules, in order.
        compile: the compiler of the functions (``torch.compile`` with Inductor by
            default); None runs them eagerly (bit for bit Megatron's layers: the tests' check of
            the functions themselves).
        attention: ``generation.decode_attention``, ``bmm``, ``flex``, ``triton`` or
            ``triton_rope`` (:attr:`LayerShape.attention`; ``triton``: an opaque custom op
            inside the compiled :func:`attention_out`, rows and span dynamic as with ``bmm``;
            ``triton_rope``: its fused-RoPE op between the compiled :func:`attention_in` and
            :func:`projection_mlp`, module docstring). With ``flex`` the
            row dimension of :func:`attention_out`'s inputs is static (marked so: one compile
            of it per row bucket, still one for every layer and span; :func:`attention_in`
            keeps its two compiles for all): Inductor takes FlexAttention's decoding (split-KV)
            kernel only for a static batch, and its CPU template of torch 2.13 does not
            compile with both the batch and the key length dynamic (a C++ compile error). A
            decoder of ``R`` rows has ``log2(R / 8) + 1`` row buckets (6 for 256), each a
            compile counted against torch.compile's recompile limit (8 by default), past which
            torch runs the function eagerly (a cache grown to more slots recompiled
            ``attention_in`` once in the tests, not ``attention_out``).

    Raises:
        NotImplementedError: from :func:`layer_weights`; ``triton_rope`` with query and key
            norms (``qk_layernorm``).
        ValueError: ``attention`` not one of ``DECODE_ATTENTIONS``.
    """

    def __init__(self, layers, compile: Optional[Callable] = torch.compile,
                 attention: str = "bmm"):
        if attention not in DECODE_ATTENTIONS:
            raise ValueError(f"decode attention must be one of {DECODE_ATTENTIONS}, got "
                             f"{attention!r}")
        read = [layer_weights(layer) for layer in layers]
        self.shape = read[0][0]
        if any(s != self.shape for s, _ in read):
            raise NotImplementedError("compiled decode layers need equal layers")
        self.shape = dataclasses.replace(self.shape, attention=attention)
        self.numbers = [layer.layer_number for layer in layers]
        self.weights: List[LayerWeights] = [w for _, w in read]
        if attention == "triton_rope" and self.weights[0].q_ln is not None:
            raise NotImplementedError("generation.decode_attention=triton_rope does not support "
                                      "query and key norms (qk_layernorm); use triton")
        self._in, self._out, self._mlp = attention_in, attention_out, projection_mlp
        if compile is not None:
            self._in = compile(attention_in)
            if attention == "triton_rope":
                self._mlp = compile(projection_mlp)
            else:
                self._out = compile(attention_out)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 cache) -> torch.Tensor:
        """The layers' output ``[1, B, h]`` for input ``hidden`` ``[1, B, h]`` (after the
        embedding) and RoPE ``cos``, ``signed_sin`` ``[1, B, 1, d_rot]``, each layer writing its
        key and value into ``cache`` (a :class:`~mcore_rl.megatron.attention.KVCache` in a
        decode mode)."""
        # [B, ...] tensors, contiguous: their strides are the same at every layer and bucket
        hidden, cos, signed_sin = hidden[0].contiguous(), cos[0], signed_sin[0]
        rows, at = cache.target(hidden.shape[0])  # the same for every layer of the step
        for t in (cos, signed_sin, rows, at):
            _dynamic(t, 0)
        delta = None  # the previous layer's MLP output, added in the next attention_in
        for number, w in zip(self.numbers, self.weights):
            _dynamic(hidden, 0)
            _dynamic(delta, 0)
            hidden, query = self._in(hidden, delta, w, cos, signed_sin, cache.keys[number],
                                     cache.values[number], rows, at, shape=self.shape)
            if self.shape.attention == "triton_rope":  # the op between two compiled parts
                hidden, delta = self._rope_attention(hidden, query, w, cos, signed_sin, at,
                                                     cache, number)
                continue
            kv = cache.read(number, rows.shape[0])
            if self.shape.attention == "flex":  # static rows (class docstring)
                hidden, delta = self._out(
                    *_static_rows(hidden, query, *kv, groups=self.shape.groups), w,
                    shape=self.shape)
                continue
            _dynamic(hidden, 0)
            _dynamic(query, 0)
            for t in kv:  # rows (or groups) and span of the cache views and the mask
                _dynamic(t, *(() if t is None else (0, 1) if t.dim() == 2 else (0, 2)))
            hidden, delta = self._out(hidden, query, kv, w, shape=self.shape)
        return (hidden + delta)[None]  # the last layer's MLP residual add (eager)

    def _rope_attention(self, hidden, qkv, w, cos, signed_sin, at, cache, number):
        """``decode_attention=triton_rope``: :func:`~mcore_rl.megatron.flash_decode.
        flash_decode_rope` on :func:`attention_in`'s projection output ``qkv`` (called as it
        is, between the compiled :func:`attention_in` and :func:`projection_mlp`: the op writes
        the cache in place, which a compiled graph would have to functionalize), then the rest
        of the layer. Returns ``(hidden, mlp_out)`` as :func:`attention_out`.

        Raises:
            NotImplementedError: RoPE over part of the head (``rotary_percent < 1``)."""
        b = hidden.shape[0]
        if cos.shape[-1] != self.shape.head_dim:
            raise NotImplementedError("generation.decode_attention=triton_rope needs RoPE over "
                                      f"the whole head ({cos.shape[-1]} of "
                                      f"{self.shape.head_dim} channels); use triton")
        keys, values, mask, prompt_keys, prompt_values = cache.read(number, b)
        core = flash_decode_rope(qkv, cos.view(b, -1), signed_sin.view(b, -1), at, keys, values,
                                 mask, self.shape.scale, prompt_keys, prompt_values)
        _dynamic(hidden, 0)
        core = core.flatten(1)[None]
        _dynamic(core, 1)
        return self._mlp(hidden, core, w, shape=self.shape)


def _static_rows(hidden: torch.Tensor, query: torch.Tensor, *kv: Optional[torch.Tensor],
                 groups: int) -> Tuple:
    """:func:`attention_out`'s ``hidden``, ``query`` and ``kv`` with the row dimension static
    (``torch._dynamo.mark_static``) and the span dynamic, as new views of the same tensors: a
    view carries none of the marks that ``attention_in``'s call or the output of a compiled
    function (torch's propagated dynamic dims) left on the tensor, which would take
    precedence over ``mark_static``. The query as ``[B, groups, np / groups, d]`` (grouped, as
    FlexAttention reads it): Inductor's CPU FlexAttention template (torch 2.13) reads the
    query's shape from its input buffer, and fails on a view of a 3-d one."""
    hidden = hidden.view(hidden.shape)
    query = query.view(query.shape[0], groups, query.shape[1] // groups, query.shape[2])
    kv = tuple(None if t is None else t.view(t.shape) for t in kv)
    for t in (hidden, query) + kv:
        if t is not None:
            torch._dynamo.mark_static(t, 0)
    for t in kv:  # the span of the cache views and the mask
        _dynamic(t, *(() if t is None else (1,) if t.dim() == 2 else (2,)))
    return hidden, query, kv


def _dynamic(t: Optional[torch.Tensor], *dims: int) -> None:
    """Mark dims of ``t`` (the row bucket, the attended span) dynamic for torch.compile: one
    compile for every bucket (not a constraint: torch may still specialize)."""
    if t is not None:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(t, dim)
