"""The decoder families the model builder supports, and the checks of a model shape and an MoE
layout that the config loader and the builder share (no Megatron import: the loader runs
before any worker).

A family is a Hugging Face ``model_type`` (:data:`FAMILIES`); what it adds to the Llama
architecture is described in :mod:`mcore_rl.megatron.model`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config import checks
from mcore_rl.config.schema import MegatronConfig, ModelArchConfig


@dataclass(frozen=True)
class Family:
    """What a Hugging Face ``model_type`` fixes about the decoder."""

    qkv_bias: bool  # biases on the q/k/v projections (and no other)
    qk_layernorm: bool  # RMSNorm over each query and key head, before RoPE (Qwen3)
    moe: bool  # every MLP is a layer of routed experts
    shared_expert: bool  # plus a shared expert gated by sigmoid(x w) (Qwen2-MoE)


# Keyed by the schema's MODEL_FAMILIES (the choices of ``model.arch.family``), in its order.
FAMILIES = {
    "llama": Family(qkv_bias=False, qk_layernorm=False, moe=False, shared_expert=False),
    "mistral": Family(qkv_bias=False, qk_layernorm=False, moe=False, shared_expert=False),
    "qwen2": Family(qkv_bias=True, qk_layernorm=False, moe=False, shared_expert=False),
    "qwen3": Family(qkv_bias=False, qk_layernorm=True, moe=False, shared_expert=False),
    "qwen2_moe": Family(qkv_bias=True, qk_layernorm=False, moe=True, shared_expert=True),
    "qwen3_moe": Family(qkv_bias=False, qk_layernorm=True, moe=True, shared_expert=False),
}


def head_dim(arch: ModelArchConfig) -> int:
    """Size of one attention head: ``arch.head_dim``, else ``hidden_size / num_attention_heads``."""
    return arch.head_dim or arch.hidden_size // arch.num_attention_heads


def arch_errors(arch: ModelArchConfig) -> list[str]:
    """Why ``arch`` (``model.arch``) describes no model of its family, one message per reason
    naming the keys; empty when it does. Checked: each key's declared choices and bounds
    (:func:`mcore_rl.config.checks.errors`: a known family, positive sizes), then the family's
    QKV bias and the MoE keys (experts only for the MoE families, top-k within them, a shared
    expert size exactly for qwen2_moe)."""
    errors = checks.errors(arch, "model.arch")
    if errors:
        return errors
    family = FAMILIES[arch.family]
    if arch.qkv_bias != family.qkv_bias:
        errors.append(f"model.arch.qkv_bias must be {str(family.qkv_bias).lower()} for family "
                      f"{arch.family} (got {str(arch.qkv_bias).lower()})")
    if family.moe != (arch.num_experts is not None):
        errors.append(f"model.arch.num_experts must be {'set' if family.moe else 'null'} for "
                      f"family {arch.family} (got {arch.num_experts})")
    if arch.num_experts is not None and not 1 <= arch.moe_router_topk <= arch.num_experts:
        errors.append(f"model.arch.moe_router_topk ({arch.moe_router_topk}) must be in [1, "
                      f"model.arch.num_experts ({arch.num_experts})]")
    if family.shared_expert != (arch.moe_shared_expert_ffn_hidden_size is not None):
        errors.append(f"model.arch.moe_shared_expert_ffn_hidden_size must be "
                      f"{'set' if family.shared_expert else 'null'} for family {arch.family} "
                      f"(got {arch.moe_shared_expert_ffn_hidden_size})")
    return errors


def layout_errors(arch: ModelArchConfig, megatron: MegatronConfig, key: str,
                  world_size: int | None = None) -> list[str]:
    """Why the MoE settings of ``megatron`` (config section ``key``, e.g. ``policy.megatron``)
    cannot run ``arch``, one message per reason naming the keys; empty when they can.

    Checked: each key's declared choices and bounds (:func:`mcore_rl.config.checks.errors`: a
    known token dispatcher, non-negative router loss coefficients, sizes >= 1), then expert
    parallelism (EP) or expert TP only with experts, ``num_experts`` divisible by EP, sequence
    parallelism with TP > 1 for MoE training (Megatron-Core's ``MoELayer`` refuses MoE + TP
    without it), and, given ``world_size`` (processes of the worker world), ``expert TP x EP x
    PP`` dividing it (Megatron's expert groups tile the same ranks as TP x DP x PP).
    """
    errors = checks.errors(megatron, key)
    if errors:
        return errors
    ep, etp = megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    if arch.num_experts is None:
        if ep > 1 or etp not in (None, tp):
            errors.append(f"{key}.expert_model_parallel_size ({ep}) and "
                          f"expert_tensor_parallel_size ({etp}) need a model with experts "
                          f"(model.arch.family {arch.family} is dense)")
        return errors
    if arch.num_experts % ep:
        errors.append(f"model.arch.num_experts ({arch.num_experts}) must be divisible by "
                      f"{key}.expert_model_parallel_size ({ep})")
    if tp > 1 and not megatron.sequence_parallel:
        errors.append(f"{key}.sequence_parallel must be true with experts and "
                      f"{key}.tensor_model_parallel_size > 1 (got {tp})")
    experts_per_layer = (etp or tp) * ep * pp
    if world_size is not None and world_size % experts_per_layer:
        errors.append(f"cluster.num_workers ({world_size}) must be divisible by "
                      f"{key}.expert_tensor_parallel_size x expert_model_parallel_size x "
                      f"pipeline_model_parallel_size ({etp or tp} x {ep} x {pp})")
    return errors


def parallel_shape_errors(arch: ModelArchConfig, megatron: MegatronConfig, key: str,
                          source: str = "model.arch") -> list[str]:
    """Why the model shape ``arch`` cannot be split over the TP/PP/VPP layout of ``megatron``
    (config section ``key``, e.g. ``policy.megatron``), one message per reason; empty when it
    can. ``source`` names where the shape comes from in the messages: ``model.arch`` (the
    config) or, for a checkpoint's shape read at load time, e.g. ``model.hf_path=/m``.

    Checked (Megatron-Core splits attention heads and KV groups over TP ranks and layers over
    PP x VPP stages): ``num_attention_heads`` and ``num_query_groups`` divisible by
    ``tensor_model_parallel_size``; ``num_layers`` divisible by
    ``pipeline_model_parallel_size x virtual_pipeline_model_parallel_size``. Sizes below 1 are
    left to the field checks.
    """
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    vpp = megatron.virtual_pipeline_model_parallel_size or 1
    errors = []
    where = "" if source == "model.arch" else f" of {source}"
    field = (lambda name: f"model.arch.{name}") if source == "model.arch" else (lambda name: name)
    if tp >= 1 and arch.num_attention_heads >= 1 and arch.num_query_groups >= 1:
        for name in ("num_attention_heads", "num_query_groups"):
            if getattr(arch, name) % tp:
                errors.append(f"{field(name)} ({getattr(arch, name)}){where} must be divisible "
                              f"by {key}.tensor_model_parallel_size ({tp})")
    if pp >= 1 and vpp >= 1 and arch.num_layers % (pp * vpp):
        errors.append(f"{field('num_layers')} ({arch.num_layers}){where} must be divisible by "
                      f"{key}.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size"
                      f" ({pp} x {megatron.virtual_pipeline_model_parallel_size or 1})")
    return errors + transformer_engine_shape_errors(arch, megatron, key, source)


def transformer_engine_shape_errors(arch: ModelArchConfig, megatron: MegatronConfig, key: str,
                                    source: str = "model.arch") -> list[str]:
    """Why the model shape ``arch`` cannot run the Transformer Engine features of ``megatron``
    (config section ``key``), one message per reason; ``source`` as in
    :func:`parallel_shape_errors`, which includes these. Empty when it can, or when TP or the
    head counts are below 1 (the field checks report those).

    Checked: with ``context_parallel_size`` CP > 1 and ``cp_comm_type=a2a`` (all-to-all over
    heads), ``num_attention_heads`` and ``num_query_groups`` divisible by TP x CP; with ``fp8``,
    the last dimension of every FP8 matrix multiply's input on a TP rank divisible by 16
    (Transformer Engine refuses others): ``hidden_size``, ``num_attention_heads x head_dim / TP``
    and ``ffn_hidden_size / TP`` (``moe_ffn_hidden_size`` / expert TP with experts); and
    ``fp8_bf16_layers_at_start`` and ``_at_end`` each at most ``num_layers / PP`` (the layers of
    one pipeline stage: Megatron-Core's ``TransformerConfig`` check).
    """
    tp, cp = megatron.tensor_model_parallel_size, megatron.context_parallel_size
    if tp < 1 or cp < 1 or arch.num_attention_heads < 1 or arch.num_query_groups < 1:
        return []
    errors = []
    where = "" if source == "model.arch" else f" of {source}"
    field = (lambda name: f"model.arch.{name}") if source == "model.arch" else (lambda name: name)
    if cp > 1 and megatron.cp_comm_type == "a2a":
        for name in ("num_attention_heads", "num_query_groups"):
            if getattr(arch, name) % (tp * cp):
                errors.append(f"{field(name)} ({getattr(arch, name)}){where} must be divisible by "
                              f"{key}.tensor_model_parallel_size x context_parallel_size "
                              f"({tp} x {cp}) with {key}.cp_comm_type=a2a (heads are split over "
                              f"CP ranks)")
    if megatron.fp8 is not None:
        moe = arch.num_experts is not None
        ffn_name = "moe_ffn_hidden_size" if moe and arch.moe_ffn_hidden_size else "ffn_hidden_size"
        ffn_split = "expert_tensor_parallel_size" if moe else "tensor_model_parallel_size"
        etp = megatron.expert_tensor_parallel_size or tp
        checked = [  # (what, its size on a rank, how it is computed)
            (field("hidden_size"), arch.hidden_size, str(arch.hidden_size)),
            (f"{field('num_attention_heads')} x head_dim / {key}.tensor_model_parallel_size",
             arch.num_attention_heads * head_dim(arch) / tp,
             f"{arch.num_attention_heads} x {head_dim(arch)} / {tp} = "
             f"{arch.num_attention_heads * head_dim(arch) / tp:g}"),
            (f"{field(ffn_name)} / {key}.{ffn_split}",
             getattr(arch, ffn_name) / (etp if moe else tp),
             f"{getattr(arch, ffn_name)} / {etp if moe else tp} = "
             f"{getattr(arch, ffn_name) / (etp if moe else tp):g}")]
        for what, size, how in checked:
            if size % 16:
                errors.append(f"{key}.fp8={megatron.fp8} needs {what}{where} to be a multiple of "
                              f"16 (got {how}): Transformer Engine's FP8 matrix multiplies")
        pp = megatron.pipeline_model_parallel_size
        for end in ("start", "end"):
            count = getattr(megatron, f"fp8_bf16_layers_at_{end}")
            if pp >= 1 and count > arch.num_layers // pp:
                errors.append(f"{key}.fp8_bf16_layers_at_{end} ({count}) must be at most the "
                              f"layers of one pipeline stage, {field('num_layers')}{where} / "
                              f"{key}.pipeline_model_parallel_size ({arch.num_layers} / {pp} = "
                              f"{arch.num_layers // pp}): Megatron-Core's bound")
    return errors


def packed_sequence_multiple(megatron: MegatronConfig) -> int:
    """What every sequence of a packed micro-batch of a Megatron worker with layout ``megatron``
    is padded to a multiple of: ``2 CP`` with context parallelism (each CP rank holds two chunks
    of 1/(2 CP) of every sequence), else 1 (no padding)."""
    cp = max(1, megatron.context_parallel_size)
    return 2 * cp if cp > 1 else 1


def microbatch_width_multiple(megatron: MegatronConfig) -> int:
    """What every micro-batch width (and packed length) of a Megatron worker with layout
    ``megatron`` is a multiple of: TP under sequence parallelism (Megatron splits the sequence
    over TP), x 2 CP with context parallelism (each CP rank holds two chunks of 1/(2 CP) for
    causal load balance: :func:`packed_sequence_multiple`), x 8 with FP8 (Transformer Engine's
    FP8 matrix multiplies need a multiple of 8 tokens on each rank). Sizes below 1 count as 1."""
    tp = max(1, megatron.tensor_model_parallel_size)
    return ((tp if megatron.sequence_parallel else 1) * packed_sequence_multiple(megatron)
            * (8 if megatron.fp8 is not None else 1))
