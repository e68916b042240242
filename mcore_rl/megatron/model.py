"""Model builder: Megatron-Core ``GPTModel`` chunks for the Llama, Mistral, Qwen2 and Qwen3
decoders and their mixture-of-experts (MoE) relatives Qwen2-MoE and Qwen3-MoE.

The architecture is the one of Touvron et al. 2023 ("LLaMA", sec. 2.2) that the others share:
pre-norm RMSNorm (Zhang & Sennrich 2019), SwiGLU MLP (Shazeer 2020), rotary position
embeddings (Su et al. 2021, non-interleaved "rotate half" layout as in Hugging Face; Llama
3.x's frequency scaling as an option), grouped query attention (Ainslie et al. 2023), no biases
except the QKV bias of the Qwen2 families. What each family adds (:data:`FAMILIES`): Qwen3's
RMSNorm of every query and key head before RoPE; the MoE families replace each MLP by routed
experts (top-k softmax router, Shazeer et al. 2017; Megatron-Core's ``MoELayer`` with expert
parallelism) and Qwen2-MoE adds a shared expert whose output is scaled by ``sigmoid(x w)``.

Vocabulary padding: Megatron shards the embedding and output rows evenly over TP, so the
model is built with :func:`padded_vocab_size` rows. The pad rows (ids ``>= vocab_size``) are
zero after :func:`mcore_rl.megatron.conversion.load_hf_weights`; their logits are not
meaningful and callers must never sample or score them (mask columns ``>= vocab_size``).

Inputs: callers pass :func:`attention_mask` for the configured layer spec: the explicit
:func:`causal_attention_mask` for ``local`` (Megatron's default mask is allocated on CUDA),
None for ``torch`` and ``transformer_engine`` (their kernels mask causally themselves).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_rl.config.families import (FAMILIES, arch_errors, head_dim, layout_errors,
                                      transformer_engine_shape_errors)
from mcore_rl.config.schema import LAYER_SPECS, MegatronConfig, ModelArchConfig

_PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """Smallest multiple of ``tensor_model_parallel_size`` that is ``>= vocab_size``: the
    number of embedding/output rows of the Megatron model (each TP rank holds an equal slice).

    Raises ``ValueError`` for a non-positive vocabulary or TP size.
    """
    if vocab_size <= 0 or tensor_model_parallel_size <= 0:
        raise ValueError(
            f"vocab_size ({vocab_size}) and tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) must be positive"
        )
    tp = tensor_model_parallel_size
    return -(-vocab_size // tp) * tp


def transformer_config(
    arch: ModelArchConfig,
    megatron: MegatronConfig,
    vocab_size: int,
    device: torch.device | str,
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` of the decoder ``arch`` (see the module docstring).

    Args:
        arch: the model shape (``model.arch``).
        megatron: parallel sizes, precision and MoE settings (``policy.megatron``).
        vocab_size: tokenizer vocabulary (checked positive; the model itself is built in
            :func:`build_model`).
        device: ``"cpu"`` turns on CPU initialization and turns off every fused kernel;
            on CUDA only the pure-PyTorch (``torch.jit``) fusions are on (bias+SwiGLU,
            bias+dropout+add), since the others need Apex or Transformer Engine.

    The RoPE base and scaling are ``GPTModel`` arguments, set in :func:`build_model`.
    Transformer Engine features (``megatron.layer_spec=transformer_engine``): ``fp8`` and
    ``fp8_recipe`` are Megatron's fields of the same names (its ``TransformerBlock`` runs each
    layer in TE's FP8 autocast; the output layer and the embedding stay bf16);
    ``fp8_bf16_layers_at_start`` and ``_at_end`` are its ``num_layers_at_start_in_bf16`` and
    ``num_layers_at_end_in_bf16``, with ``first_last_layers_bf16`` when either is above 0 (those
    layers run outside the FP8 autocast);
    ``context_parallel_size`` and ``cp_comm_type`` (set only with CP > 1) go to TE's attention
    (the ``torch`` spec's attention all-gathers keys and values whatever ``cp_comm_type`` says;
    the config loader asks for ``all_gather`` with it).
    Precision ``fp32`` keeps fp32 params; ``bf16`` builds bf16 params with ``bf16=True`` (the
    optimizer then keeps fp32 main params). ``calculate_per_token_loss=True``: Megatron sums
    the loss over microbatches and DP and ``finalize_model_grads`` divides the grads by the
    all-reduced token count.

    MoE (``arch.num_experts`` set): Megatron's router with a softmax score, top-k after the
    softmax (``moe_router_pre_softmax``) unless ``arch.moe_norm_topk_prob`` (top-k of the logits,
    then a softmax over those k: the renormalized probabilities), no token dropping, the
    load-balancing and z-loss coefficients of ``megatron`` (which positions they count and
    their weight: :mod:`mcore_rl.megatron.moe`), and the experts as ``SequentialMLP``
    (``local``/``torch`` specs) or TE's grouped GEMM (``transformer_engine``).

    Raises ``ValueError`` naming the config key for a non-positive vocabulary or what
    :func:`arch_errors`, :func:`layout_errors` and :func:`transformer_engine_shape_errors`
    report (each key's declared choices and bounds included: an unknown precision or layer
    spec, ...), for FP8 without the ``transformer_engine`` layer spec and for CP with the
    ``local`` one (the ``torch`` spec's attention does CP by all-gathering keys and values:
    :mod:`mcore_rl.megatron.context_parallel`), and for bf16 layers without FP8 or with the
    ``delayed`` recipe.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    errors = (arch_errors(arch) or layout_errors(arch, megatron, "megatron")
              or transformer_engine_shape_errors(arch, megatron, "megatron"))
    if not errors and megatron.layer_spec != "transformer_engine" and megatron.fp8 is not None:
        errors = [f"megatron.fp8={megatron.fp8} needs megatron.layer_spec=transformer_engine "
                  f"(got {megatron.layer_spec})"]
    if not errors and megatron.layer_spec == "local" and megatron.context_parallel_size > 1:
        errors = [f"megatron.context_parallel_size={megatron.context_parallel_size} needs "
                  f"megatron.layer_spec torch or transformer_engine (got local: Megatron's "
                  f"DotProductAttention does not split sequences)"]
    bf16_ends = megatron.fp8_bf16_layers_at_start > 0 or megatron.fp8_bf16_layers_at_end > 0
    if not errors and bf16_ends and (megatron.fp8 is None or megatron.fp8_recipe == "delayed"):
        errors = [f"megatron.fp8_bf16_layers_at_start and _at_end (got "
                  f"{megatron.fp8_bf16_layers_at_start} and {megatron.fp8_bf16_layers_at_end}) "
                  f"need megatron.fp8 with a recipe other than delayed (got fp8={megatron.fp8}, "
                  f"fp8_recipe={megatron.fp8_recipe})"]
    if errors:
        raise ValueError("; ".join(errors))
    on_cpu = torch.device(device).type == "cpu"
    dtype = _PARAMS_DTYPES[megatron.precision]
    moe = {}
    if arch.num_experts is not None:
        from mcore_rl.megatron.moe import router_loss_coefficients

        aux_coeff, z_coeff = router_loss_coefficients(
            megatron.moe_aux_loss_coeff, megatron.moe_z_loss_coeff,
            megatron.tensor_model_parallel_size)
        moe = dict(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_router_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
            moe_router_pre_softmax=not arch.moe_norm_topk_prob,
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=FAMILIES[arch.family].shared_expert,
            moe_token_dispatcher_type=megatron.moe_token_dispatcher_type,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=aux_coeff,
            moe_z_loss_coeff=z_coeff,
            moe_grouped_gemm=megatron.layer_spec == "transformer_engine",
            expert_model_parallel_size=megatron.expert_model_parallel_size,
            expert_tensor_parallel_size=megatron.expert_tensor_parallel_size,
        )
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=head_dim(arch),
        qk_layernorm=FAMILIES[arch.family].qk_layernorm,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=megatron.tensor_model_parallel_size,
        pipeline_model_parallel_size=megatron.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=megatron.virtual_pipeline_model_parallel_size,
        # The interleaved schedule sends activations forward and gradients backward in one
        # call; with PP=2 the previous and the next stage are one peer, and batched p2p ops to
        # one peer are matched in posting order, which swaps activations and gradients
        # (measured: wrong gradients on gloo). Megatron's unbatched path (_p2p_ops) puts the two
        # directions on different communicators.
        batch_p2p_comm=megatron.virtual_pipeline_model_parallel_size is None,
        sequence_parallel=megatron.sequence_parallel,
        context_parallel_size=megatron.context_parallel_size,
        cp_comm_type=megatron.cp_comm_type if megatron.context_parallel_size > 1 else None,
        fp8=megatron.fp8,
        fp8_recipe=megatron.fp8_recipe,
        first_last_layers_bf16=bf16_ends,
        num_layers_at_start_in_bf16=megatron.fp8_bf16_layers_at_start,
        num_layers_at_end_in_bf16=megatron.fp8_bf16_layers_at_end,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=megatron.precision == "bf16",
        calculate_per_token_loss=True,
        use_cpu_initialization=on_cpu,
        bias_activation_fusion=not on_cpu,
        bias_dropout_fusion=not on_cpu,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        **recompute_options(megatron),
        **moe,
    )


def recompute_options(megatron: MegatronConfig) -> dict:
    """``TransformerConfig`` arguments of ``megatron.recompute_granularity`` (Korthikanti et al.
    2022, sec. 5): none without it; ``"full"`` with ``recompute_method`` and
    ``recompute_num_layers``; ``"selective"`` with Megatron's default ``recompute_modules``
    (the core attention) and no method (Megatron refuses one)."""
    if megatron.recompute_granularity is None:
        return {}
    if megatron.recompute_granularity == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": megatron.recompute_method,
            "recompute_num_layers": megatron.recompute_num_layers}


def layer_spec(name: str, num_experts: int | None = None, qk_layernorm: bool = False) -> ModuleSpec:
    """The ``TransformerLayer`` spec of ``megatron.layer_spec`` (all RMSNorm, SwiGLU, RoPE):

    - ``"local"``: Megatron's own modules (``get_gpt_layer_local_spec``), whose core attention
      (``DotProductAttention``) materializes the ``[b, heads, s, s]`` scores; norms are
      :class:`RMSNorm` (sequence-parallel aware); experts are Megatron's ``SequentialMLP``.
    - ``"torch"``: the local spec with its core attention replaced by
      :class:`~mcore_rl.megatron.attention.TorchSDPAttention` (torch's fused SDPA kernels).
      Same parameters and names as ``"local"``, so conversion and checkpoints are shared.
    - ``"transformer_engine"``: Megatron's TE spec (``get_gpt_layer_with_transformer_engine_spec``;
      norms fused into the next linear, experts in TE's grouped GEMM, so its parameter names
      differ from ``"local"``: :mod:`mcore_rl.megatron.conversion` knows both).

    ``num_experts`` (None: a dense MLP) and ``qk_layernorm`` (an RMSNorm over each query and
    key head) are Megatron's spec arguments of the same names.

    Raises:
        ValueError: an unknown name (config key ``megatron.layer_spec``), or
            ``"transformer_engine"`` when ``transformer_engine`` does not import.
    """
    if name not in LAYER_SPECS:
        raise ValueError(f"megatron.layer_spec must be one of {LAYER_SPECS}, got {name!r}")
    if name == "transformer_engine":
        from mcore_rl.megatron.te import te_import_error

        problem = te_import_error()
        if problem:
            raise ValueError(
                "megatron.layer_spec=transformer_engine needs Transformer Engine, which does not "
                f"import here ({problem}); use megatron.layer_spec=torch (torch SDPA attention)")
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None,
            qk_layernorm=qk_layernorm)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                    normalization="RMSNorm")
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    attention = spec.submodules.self_attention.submodules
    if qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    if name == "torch":
        from mcore_rl.megatron.attention import TorchSDPAttention

        attention.core_attention = TorchSDPAttention
    return spec


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (Zhang & Sennrich 2019) built from Megatron's norm arguments, the
    norm of the ``local`` and ``torch`` specs (layers and final norm).

    With sequence parallelism each TP rank normalizes only its ``s / TP`` positions, so the
    weight's gradient is a partial sum: the weight carries Megatron's ``sequence_parallel``
    flag, and ``finalize_model_grads`` all-reduces the flagged gradients over TP (Megatron's
    Apex ``FusedLayerNorm`` and TE norms do the same; its torch fallback ``WrappedTorchNorm``,
    used without Apex, refuses sequence parallelism instead).

    Args: ``config`` (``normalization`` must be ``"RMSNorm"``), ``hidden_size``, ``eps``; the
    other Megatron norm arguments are ignored. Forward: ``[..., hidden]`` -> same shape and
    dtype. Raises ``ValueError`` for another ``config.normalization``.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 **unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"RMSNorm built for config.normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _decoder_spec(name: str, config: TransformerConfig, vp_stage: int | None) -> ModuleSpec:
    """The decoder spec of one chunk: for ``local``/``torch`` a ``TransformerBlock`` spec whose
    final norm is :class:`RMSNorm` too (Megatron would pick ``WrappedTorchNorm`` without
    Apex), built as ``get_gpt_decoder_block_spec`` does; the TE layer spec as it is."""
    spec = layer_spec(name, config.num_moe_experts, config.qk_layernorm)
    if name == "transformer_engine":
        return spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[spec] * layers, layer_norm=RMSNorm))


def _define_te_gemm_without_te() -> None:
    """megatron-core 0.16 imports ``te_general_gemm`` into ``moe_utils`` only when Transformer
    Engine imports, and its router's gating linear then reads the missing name (``NameError``);
    0.19 sets it to None without TE. Define it as None where it is missing (the router then
    uses ``torch.mm``)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_model(
    arch: ModelArchConfig,
    megatron: MegatronConfig,
    vocab_size: int,
    device: torch.device | str,
) -> list[GPTModel]:
    """Build this rank's ``GPTModel`` chunks, one per virtual pipeline stage (one without VPP).

    Needs Megatron's ``parallel_state`` initialized with the same TP/PP/VPP/EP/expert-TP/CP sizes
    (:func:`mcore_rl.megatron.parallel.initialize`). Embedding and output layer have
    :func:`padded_vocab_size` rows; embeddings are tied when ``arch.tie_word_embeddings``.
    Weights are Megatron's random init; load real ones with
    :func:`mcore_rl.megatron.conversion.load_hf_weights`.

    Layers follow :func:`layer_spec` (``megatron.layer_spec``). Forward: ``chunk(input_ids
    [b,s] int64, position_ids [b,s], attention_mask)`` (the mask from :func:`attention_mask`:
    ``[b,1,s,s]`` bool, or None for the torch/TE specs) returns logits ``[b, s, padded_vocab/tp]`` on the last stage (hidden states
    ``[s, b, h]`` elsewhere).

    ``megatron.compile_layers`` compiles each ``TransformerLayer`` in place
    (``nn.Module.compile``: torch.compile with the module's names kept).

    Raises ``ValueError`` as :func:`transformer_config`, when Megatron's parallel state
    disagrees with the config's TP/PP/VPP/EP/expert-TP/CP sizes, or for ``compile_layers`` off
    CUDA.
    """
    config = transformer_config(arch, megatron, vocab_size, device)
    if arch.num_experts is not None:
        _define_te_gemm_without_te()
    state = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    )
    wanted = (
        megatron.tensor_model_parallel_size,
        megatron.pipeline_model_parallel_size,
        megatron.virtual_pipeline_model_parallel_size,
        megatron.expert_model_parallel_size,
        megatron.expert_tensor_parallel_size or megatron.tensor_model_parallel_size,
        megatron.context_parallel_size,
    )
    if state != wanted:
        raise ValueError(
            f"megatron (tensor, pipeline, virtual pipeline, expert, expert tensor, context) sizes "
            f"{wanted} differ from the initialized parallel state {state}"
        )
    if megatron.compile_layers and torch.device(device).type != "cuda":
        raise ValueError(f"megatron.compile_layers needs a CUDA device, got {device!r}")
    vpp = megatron.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    padded = padded_vocab_size(vocab_size, megatron.tensor_model_parallel_size)
    chunks = []
    for vp_stage in stages:
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=_decoder_spec(megatron.layer_spec, config, vp_stage),
                vocab_size=padded,
                max_sequence_length=arch.max_position_embeddings,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=vp_stage
                ),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=vp_stage
                ),
                share_embeddings_and_output_weights=arch.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_base=arch.rope_theta,
                rope_scaling=arch.rope_scaling_factor is not None,
                rope_scaling_factor=arch.rope_scaling_factor or 8.0,
                vp_stage=vp_stage,
            ).to(device)  # as Megatron-LM's get_model: the local spec's torch norms start on the CPU
        )
        if megatron.compile_layers:  # in place: parameter names (conversion, checkpoints) stay
            for layer in chunks[-1].decoder.layers:
                layer.compile()
    return chunks


def wrap_float16(chunks: list[torch.nn.Module], precision: str) -> list[torch.nn.Module]:
    """Wrap each chunk in Megatron's ``Float16Module`` when ``precision`` is ``"bf16"``, as
    Megatron-LM's ``get_model`` does (``fp32`` returns the chunks as they are).

    The wrapper casts the chunk to bf16, casts float inputs of the first stage to bf16 and
    the last stage's output to fp32 (``fp32_output=True``); Megatron's optimizer then keeps
    fp32 main params and DDP fp32 grads (``ddp.grad_reduce_in_fp32``). Load weights before
    the optimizer is built, so its fp32 main copies start from them. Every parameter becomes
    bf16 (the local spec's torch norms are built fp32 whatever ``params_dtype`` says) except
    the fp32 ones marked ``param.keep_fp32 = True`` (a value head kept in fp32 on purpose),
    which keep their exact values. ``megatron.core.utils.unwrap_model`` sees through the
    wrapper (the HF conversion uses it).

    Raises ``ValueError`` for an unknown precision (config key ``megatron.precision``).
    """
    if precision not in _PARAMS_DTYPES:
        raise ValueError(f"megatron.precision must be one of {sorted(_PARAMS_DTYPES)}, "
                         f"got {precision!r}")
    if precision == "fp32":
        return chunks
    from megatron.core.transformer.module import Float16Module

    wrapped = []
    for chunk in chunks:
        kept = [(p, p.data) for p in chunk.parameters()
                if p.dtype == torch.float32 and getattr(p, "keep_fp32", False)]
        wrapped.append(Float16Module(chunk.config, chunk))
        for p, data in kept:
            p.data = data
    return wrapped


def causal_attention_mask(batch: int, seq: int, device: torch.device | str) -> torch.Tensor:
    """Causal mask ``[batch, 1, seq, seq]`` bool, ``True`` = masked (key after query).

    A broadcast view of one ``[seq, seq]`` upper triangle (no ``batch`` copies).
    """
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu_(1)
    return mask.view(1, 1, seq, seq).expand(batch, 1, seq, seq)


def attention_mask(layer_spec_name: str, batch: int, seq: int,
                   device: torch.device | str) -> torch.Tensor | None:
    """The ``attention_mask`` forward argument for right-padded rows of one micro-batch.

    Right padding needs only the causal mask (a valid token never sees a later pad). The
    ``torch`` and ``transformer_engine`` specs apply causal masking themselves when the mask is
    None (their attention's ``attn_mask_type`` is causal), which lets the fused kernels skip
    the masked half instead of reading a mask: None for them, :func:`causal_attention_mask`
    for ``local`` (whose own default causal mask is allocated on CUDA).

    Raises ``ValueError`` for an unknown spec name (:data:`LAYER_SPECS`).
    """
    if layer_spec_name not in LAYER_SPECS:
        raise ValueError(f"megatron.layer_spec must be one of {LAYER_SPECS}, got {layer_spec_name!r}")
    if layer_spec_name == "local":
        return causal_attention_mask(batch, seq, device)
    return None


def position_ids(batch: int, seq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions ``[batch, seq]`` int64, ``0 .. seq-1`` per row (right-padded sequences).

    Megatron's RoPE path takes positions from the sequence index, so this is what it
    computes internally; the tensor is still a required forward argument.
    """
    return torch.arange(seq, device=device).view(1, seq).expand(batch, seq)
