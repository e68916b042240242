"""Model builder: Megatron-Core ``GPTModel`` chunks for a Llama/Qwen2-family decoder.

The architecture is the one of Touvron et al. 2023 ("LLaMA", sec. 2.2) that Qwen2 shares:
pre-norm RMSNorm (Zhang & Sennrich 2019), SwiGLU MLP (Shazeer 2020), rotary position
embeddings (Su et al. 2021, non-interleaved "rotate half" layout as in Hugging Face), grouped
query attention (Ainslie et al. 2023), no biases except the optional QKV bias of Qwen2.

Vocabulary padding: Megatron shards the embedding and output rows evenly over TP, so the
model is built with :func:`padded_vocab_size` rows. The pad rows (ids ``>= vocab_size``) are
zero after :func:`mcore_rl.megatron.conversion.load_hf_weights`; their logits are not
meaningful and callers must never sample or score them (mask columns ``>= vocab_size``).

Inputs: Megatron's default attention mask is allocated on CUDA, so callers pass
:func:`causal_attention_mask` explicitly (it is also what the GPU path uses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from mcore_rl.config.schema import MegatronConfig, ModelArchConfig

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
    """Megatron ``TransformerConfig`` of a Llama/Qwen2 decoder.

    Args:
        arch: the model shape (``model.arch``).
        megatron: parallel sizes and precision (``policy.megatron``).
        vocab_size: tokenizer vocabulary (checked positive; the model itself is built in
            :func:`build_model`).
        device: ``"cpu"`` turns on CPU initialization and turns off every fused kernel;
            on CUDA only the pure-PyTorch (``torch.jit``) fusions are on (bias+SwiGLU,
            bias+dropout+add), since the others need Apex or Transformer Engine.

    The RoPE base (``arch.rope_theta``) is a ``GPTModel`` argument, set in :func:`build_model`.
    Precision ``fp32`` keeps fp32 params; ``bf16`` builds bf16 params with ``bf16=True`` (the
    optimizer then keeps fp32 main params). ``calculate_per_token_loss=True``: Megatron sums
    the loss over microbatches and DP and ``finalize_model_grads`` divides the grads by the
    all-reduced token count.

    Raises ``ValueError`` naming the config key for an unknown precision, a layer spec other
    than ``local``, or a non-positive vocabulary.
    """
    if megatron.precision not in _PARAMS_DTYPES:
        raise ValueError(
            f"megatron.precision must be one of {sorted(_PARAMS_DTYPES)}, "
            f"got {megatron.precision!r}"
        )
    if megatron.layer_spec != "local":
        raise ValueError(f"megatron.layer_spec must be 'local', got {megatron.layer_spec!r}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    on_cpu = torch.device(device).type == "cpu"
    dtype = _PARAMS_DTYPES[megatron.precision]
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
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
        sequence_parallel=megatron.sequence_parallel,
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
    )


def build_model(
    arch: ModelArchConfig,
    megatron: MegatronConfig,
    vocab_size: int,
    device: torch.device | str,
) -> list[GPTModel]:
    """Build this rank's ``GPTModel`` chunks, one per virtual pipeline stage (one without VPP).

    Needs Megatron's ``parallel_state`` initialized with the same TP/PP/VPP sizes
    (:func:`mcore_rl.megatron.parallel.initialize`). Embedding and output layer have
    :func:`padded_vocab_size` rows; embeddings are tied when ``arch.tie_word_embeddings``.
    Weights are Megatron's random init; load real ones with
    :func:`mcore_rl.megatron.conversion.load_hf_weights`.

    Forward: ``chunk(input_ids [b,s] int64, position_ids [b,s], attention_mask [b,1,s,s]
    bool)`` returns logits ``[b, s, padded_vocab/tp]`` on the last stage (hidden states
    ``[s, b, h]`` elsewhere).

    Raises ``ValueError`` as :func:`transformer_config`, or when Megatron's parallel state
    disagrees with the config's TP/PP/VPP sizes.
    """
    config = transformer_config(arch, megatron, vocab_size, device)
    state = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
    )
    wanted = (
        megatron.tensor_model_parallel_size,
        megatron.pipeline_model_parallel_size,
        megatron.virtual_pipeline_model_parallel_size,
    )
    if state != wanted:
        raise ValueError(
            f"megatron (tensor, pipeline, virtual pipeline) sizes {wanted} differ from the "
            f"initialized parallel state {state}"
        )
    vpp = megatron.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    padded = padded_vocab_size(vocab_size, megatron.tensor_model_parallel_size)
    chunks = []
    for vp_stage in stages:
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
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
                vp_stage=vp_stage,
            )
        )
    return chunks


def causal_attention_mask(batch: int, seq: int, device: torch.device | str) -> torch.Tensor:
    """Causal mask ``[batch, 1, seq, seq]`` bool, ``True`` = masked (key after query).

    A broadcast view of one ``[seq, seq]`` upper triangle (no ``batch`` copies).
    """
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu_(1)
    return mask.view(1, 1, seq, seq).expand(batch, 1, seq, seq)


def position_ids(batch: int, seq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions ``[batch, seq]`` int64, ``0 .. seq-1`` per row (right-padded sequences).

    Megatron's RoPE path takes positions from the sequence index, so this is what it
    computes internally; the tensor is still a required forward argument.
    """
    return torch.arange(seq, device=device).view(1, seq).expand(batch, seq)
