"""Hugging Face <-> Megatron-Core weights for Llama/Qwen2-family decoders (local layer spec).

Each Megatron parameter is bound to the HF tensors it is made of and a *layout* saying how
they are fused and sharded over tensor parallelism (TP); on TP rank ``r`` of ``tp``:

- ``replicated``: the HF tensor itself (RMSNorm weights).
- ``row``: column slice ``r`` of the HF tensor (``RowParallelLinear``: o_proj, down_proj).
- ``vocab``: row slice ``r`` of the HF tensor padded with zero rows to
  :func:`~mcore_rl.megatron.model.padded_vocab_size` (embedding, lm_head).
- ``qkv``: row slice ``r`` of q/k/v interleaved per query group,
  ``[q heads of group g (np/ng*hn rows); k_g (hn); v_g (hn)]`` for g = 0..ng-1 (the layout
  ``SelfAttention.get_query_key_value_tensors`` splits; also when ng < tp).
- ``gate_up``: ``[gate slice r; up slice r]``: gate and up are sharded separately, then
  stacked, since the MLP applies SiLU to the first half of each rank's shard.

Layer indices: a chunk's ``decoder.layers[j]`` is HF layer ``layer_number - 1``, the global
number Megatron itself assigns (``get_transformer_layer_offset``), so PP and VPP splits
follow the model's own numbering. With tied embeddings and PP > 1 the last stage holds a copy
of the embedding as ``output_layer.weight``: it is loaded from ``model.embed_tokens.weight``
and never exported.

megatron-bridge (``megatron.bridge.AutoBridge``: ``AutoBridge.from_hf_pretrained(path)``,
``bridge.load_hf_weights(model)``, ``bridge.export_hf_weights(model)``) covers many more
architectures and the Transformer Engine spec; it is not installed on CPU machines and is not
wired in here. It would replace :func:`load_hf_weights` and :func:`export_hf_weights` as a
whole when importable, behind the same signatures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from mcore_rl.config.schema import MODEL_FAMILIES, ModelArchConfig

_REPLICATED, _ROW, _VOCAB, _QKV, _GATE_UP = "replicated", "row", "vocab", "qkv", "gate_up"
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class _Rule:
    megatron: str  # parameter name, relative to "decoder.layers.{j}." for layer rules
    hf: tuple[str, ...]  # HF names, relative to "model.layers.{i}." for layer rules
    layout: str


# Local spec: the two norms are modules of their own. The Transformer Engine spec fuses them
# into the next linear ("self_attention.linear_qkv.layer_norm_weight",
# "mlp.linear_fc1.layer_norm_weight"); a TE table would differ in those two rows only.
_LAYER_RULES = (
    _Rule("input_layernorm.weight", ("input_layernorm.weight",), _REPLICATED),
    _Rule(
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        _QKV,
    ),
    _Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), _ROW),
    _Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), _REPLICATED),
    _Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), _GATE_UP),
    _Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), _ROW),
)
_QKV_BIAS_RULE = _Rule(
    "self_attention.linear_qkv.bias",
    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    _QKV,
)
_EMBEDDING_RULE = _Rule("embedding.word_embeddings.weight", (_EMBED,), _VOCAB)
_FINAL_NORM_RULE = _Rule("decoder.final_layernorm.weight", ("model.norm.weight",), _REPLICATED)
_OUTPUT_RULE = _Rule("output_layer.weight", (_LM_HEAD,), _VOCAB)
_TIED_OUTPUT_RULE = _Rule("output_layer.weight", (_EMBED,), _VOCAB)


@dataclass
class _Binding:
    param: torch.nn.Parameter
    hf: tuple[str, ...]  # full HF names
    layout: str
    export: bool  # False for the last stage's copy of tied embeddings


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def hf_config_to_arch(hf_config) -> ModelArchConfig:
    """``ModelArchConfig`` of a Hugging Face ``LlamaConfig`` or ``Qwen2Config``.

    ``qkv_bias`` is True for Qwen2 (its q/k/v projections always have a bias) and False for
    Llama. Raises ``ValueError`` naming the config field for what the Megatron model here does
    not reproduce: another ``model_type``, an activation other than SiLU, RoPE scaling
    (``rope_parameters.rope_type`` other than ``default``), sliding-window attention, a
    ``head_dim`` other than ``hidden_size / num_attention_heads``, Llama's
    ``attention_bias`` (it biases o_proj too) or ``mlp_bias``.
    """
    family = getattr(hf_config, "model_type", None)
    if family not in MODEL_FAMILIES:
        raise ValueError(f"config model_type={family!r} is not supported (one of {MODEL_FAMILIES})")

    def unsupported(field: str, value, why: str):
        raise ValueError(f"{family} config field {field}={value!r} is not supported: {why}")

    if hf_config.hidden_act != "silu":
        unsupported("hidden_act", hf_config.hidden_act, "the MLP is SwiGLU (silu)")
    rope = getattr(hf_config, "rope_parameters", None)
    if rope is None:  # transformers 4.x: rope_theta and rope_scaling are separate fields
        rope = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", hf_config.rope_theta)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        unsupported("rope_parameters.rope_type", rope_type, "only unscaled RoPE is built")
    heads = hf_config.num_attention_heads
    if hf_config.hidden_size % heads:
        unsupported("num_attention_heads", heads, "hidden_size must be a multiple of it")
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and head_dim != hf_config.hidden_size // heads:
        unsupported("head_dim", head_dim, "must equal hidden_size/num_attention_heads")
    if family == "llama":
        if getattr(hf_config, "attention_bias", False):
            unsupported("attention_bias", True, "Llama's attention_bias also biases o_proj")
        if getattr(hf_config, "mlp_bias", False):
            unsupported("mlp_bias", True, "the MLP has no bias")
    if getattr(hf_config, "use_sliding_window", False):
        unsupported("use_sliding_window", True, "sliding-window attention is not built")
    layer_types = getattr(hf_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        unsupported("layer_types", layer_types, "every layer must be full_attention")
    return ModelArchConfig(
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        ffn_hidden_size=hf_config.intermediate_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=family == "qwen2",
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        vocab_size=hf_config.vocab_size,
    )


def arch_to_hf_config(arch: ModelArchConfig, vocab_size: int):
    """Hugging Face ``Qwen2Config`` or ``LlamaConfig`` (fp32, unscaled RoPE) of ``arch`` with
    ``vocab_size`` rows (unpadded). Token ids (bos/eos/pad) are left unset: they belong to the
    tokenizer.

    Raises ``ValueError`` naming ``model.arch.*`` for an unknown family, or a ``qkv_bias`` the
    family cannot express (Qwen2 always has it; Llama's ``attention_bias`` would also bias
    o_proj).
    """
    from transformers import LlamaConfig, Qwen2Config

    if arch.family not in MODEL_FAMILIES:
        raise ValueError(f"model.arch.family must be one of {MODEL_FAMILIES}, got {arch.family!r}")
    if arch.qkv_bias != (arch.family == "qwen2"):
        raise ValueError(
            f"model.arch.qkv_bias={arch.qkv_bias} cannot be expressed by a {arch.family} config "
            f"(qwen2 always has a QKV bias, llama never without an o_proj bias)"
        )
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups,
        hidden_act="silu",
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype="float32",
    )
    if arch.family == "qwen2":
        return Qwen2Config(use_sliding_window=False, **fields)
    return LlamaConfig(attention_bias=False, mlp_bias=False, **fields)


def _hf_shapes(arch: ModelArchConfig, vocab_size: int) -> dict[str, torch.Size]:
    """HF tensor names (in the HF model's ``state_dict`` order) and shapes, read from a
    ``transformers`` model built on the meta device; ``lm_head.weight`` dropped when tied."""
    key = tuple(getattr(arch, f.name) for f in dataclasses.fields(ModelArchConfig))
    return dict(_hf_shapes_cached(key, vocab_size))


@functools.lru_cache(maxsize=8)
def _hf_shapes_cached(arch_key: tuple, vocab_size: int) -> tuple:
    from transformers import AutoModelForCausalLM

    arch = ModelArchConfig(*arch_key)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(arch_to_hf_config(arch, vocab_size))
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if arch.tie_word_embeddings:
        shapes.pop(_LM_HEAD, None)
    return tuple(shapes.items())


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int):
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, arch: ModelArchConfig) -> list[torch.Tensor]:
    groups, heads = arch.num_query_groups, arch.num_attention_heads
    head_dim = arch.hidden_size // heads
    rest = qkv.shape[1:]
    sizes = [heads // groups * head_dim, head_dim, head_dim]
    per_group = qkv.reshape(groups, sum(sizes), *rest)
    return [t.reshape(-1, *rest) for t in per_group.split(sizes, dim=1)]


def _to_local(layout: str, hf: list[torch.Tensor], arch, tp: int, rank: int, rows: int):
    """This TP rank's Megatron tensor from the HF tensors (``rows``: padded vocab rows)."""
    if layout == _REPLICATED:
        return hf[0]
    if layout == _ROW:
        return hf[0].chunk(tp, dim=1)[rank]
    if layout == _VOCAB:
        (full,) = hf
        pad = full.new_zeros(rows - full.shape[0], *full.shape[1:])
        return torch.cat([full, pad]).chunk(tp, dim=0)[rank]
    if layout == _QKV:
        return _interleave_qkv(*hf, arch.num_query_groups).chunk(tp, dim=0)[rank]
    if layout == _GATE_UP:
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    raise AssertionError(layout)


def _to_hf(layout: str, shards: list[torch.Tensor], arch, vocab_size: int):
    """The HF tensors (in the rule's order) from the Megatron tensors of all TP ranks."""
    if layout == _REPLICATED:
        return [shards[0].clone()]
    if layout == _ROW:
        return [torch.cat(shards, dim=1)]
    if layout == _VOCAB:
        return [torch.cat(shards)[:vocab_size]]
    if layout == _QKV:
        return _split_qkv(torch.cat(shards), arch)
    if layout == _GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise AssertionError(layout)


def _bindings(chunk, arch: ModelArchConfig) -> dict[str, _Binding]:
    """Every parameter of one (unwrapped) ``GPTModel`` chunk, bound to its HF tensors.

    Raises ``ValueError`` listing parameters without a rule (another layer spec or an
    architecture feature the tables do not cover) or rules without a parameter.
    """
    params = dict(chunk.named_parameters())
    wanted: list[tuple[str, _Rule, tuple[str, ...], bool]] = []  # name, rule, HF names, export
    if chunk.pre_process:
        wanted.append((_EMBEDDING_RULE.megatron, _EMBEDDING_RULE, _EMBEDDING_RULE.hf, True))
    layer_rules = _LAYER_RULES + ((_QKV_BIAS_RULE,) if arch.qkv_bias else ())
    for j, layer in enumerate(chunk.decoder.layers):
        i = layer.layer_number - 1
        for rule in layer_rules:
            hf = tuple(f"model.layers.{i}.{name}" for name in rule.hf)
            wanted.append((f"decoder.layers.{j}.{rule.megatron}", rule, hf, True))
    if chunk.post_process:
        wanted.append((_FINAL_NORM_RULE.megatron, _FINAL_NORM_RULE, _FINAL_NORM_RULE.hf, True))
        if _OUTPUT_RULE.megatron in params:  # absent when tied on a stage with the embedding
            rule = _TIED_OUTPUT_RULE if arch.tie_word_embeddings else _OUTPUT_RULE
            wanted.append((rule.megatron, rule, rule.hf, not arch.tie_word_embeddings))
    absent = [name for name, *_ in wanted if name not in params]
    unbound = sorted(set(params) - {name for name, *_ in wanted})
    if absent or unbound:
        raise ValueError(
            f"Megatron chunk and {arch.family} conversion rules disagree: parameters without a "
            f"rule {unbound}, rules without a parameter {absent} (check model.arch against "
            f"the built model and megatron.layer_spec=local)"
        )
    return {
        name: _Binding(params[name], hf, rule.layout, export) for name, rule, hf, export in wanted
    }


# ---------------------------------------------------------------------------------------------
# Import / export
# ---------------------------------------------------------------------------------------------


def load_hf_weights(
    model_chunks: Iterable[torch.nn.Module],
    hf_state_dict: Mapping[str, torch.Tensor],
    arch: ModelArchConfig,
) -> None:
    """Copy HF-named full tensors into this rank's Megatron chunks (any TP/PP/VPP layout).

    Args:
        model_chunks: this rank's chunks from :func:`mcore_rl.megatron.model.build_model`,
            bare or wrapped (Megatron DDP / ``Float16Module``). Load before building the
            optimizer: its fp32 main params are copies made at construction.
        hf_state_dict: the whole model's tensors by HF name (every rank passes all of them;
            each copies its own slice). A tied ``lm_head.weight`` may be present if it equals
            ``model.embed_tokens.weight``. Any dtype; values are cast to the param dtype.
        arch: the model shape; ``arch.vocab_size`` (if set) must equal the embedding rows.

    Vocab pad rows (``>= vocab_size``) are set to zero.

    Raises ``ValueError`` listing missing and unexpected HF names, wrong shapes, a tied
    ``lm_head.weight`` that differs from the embedding, or Megatron parameters that no rule
    writes (each parameter is written exactly once).
    """
    chunks = unwrap_model(list(model_chunks))
    hf = dict(hf_state_dict)
    if _EMBED not in hf:
        raise ValueError(f"HF state dict has no {_EMBED}")
    vocab_size = hf[_EMBED].shape[0]
    if arch.vocab_size is not None and arch.vocab_size != vocab_size:
        raise ValueError(
            f"model.arch.vocab_size={arch.vocab_size} but {_EMBED} has {vocab_size} rows"
        )
    if arch.tie_word_embeddings and _LM_HEAD in hf:
        if not torch.equal(hf.pop(_LM_HEAD), hf[_EMBED]):
            raise ValueError(f"tied embeddings, but {_LM_HEAD} differs from {_EMBED}")
    shapes = _hf_shapes(arch, vocab_size)
    missing, extra = sorted(set(shapes) - set(hf)), sorted(set(hf) - set(shapes))
    if missing or extra:
        raise ValueError(
            f"HF state dict does not match model.arch ({arch.family}, {arch.num_layers} layers, "
            f"tie_word_embeddings={arch.tie_word_embeddings}): missing {missing}, "
            f"unexpected {extra}"
        )
    wrong = {n: (tuple(hf[n].shape), tuple(s)) for n, s in shapes.items() if hf[n].shape != s}
    if wrong:
        raise ValueError(f"HF tensor shapes (got, expected from model.arch): {wrong}")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for index, chunk in enumerate(chunks):
        for name, binding in _bindings(chunk, arch).items():
            param = binding.param
            rows = param.shape[0] * tp
            source = [hf[n].to(param.device) for n in binding.hf]
            local = _to_local(binding.layout, source, arch, tp, rank, rows)
            if local.shape != param.shape:
                raise ValueError(
                    f"chunk {index} {name}: converted shape {tuple(local.shape)} from "
                    f"{binding.hf} differs from the Megatron parameter {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(local)


def _gather_tp(binding: _Binding) -> list[torch.Tensor]:
    local = binding.param.detach()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if binding.layout == _REPLICATED or tp == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(tp)]
    group = parallel_state.get_tensor_model_parallel_group()
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


@torch.no_grad()
def export_hf_weights(
    model_chunks: Iterable[torch.nn.Module],
    arch: ModelArchConfig,
    vocab_size: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model on every rank, in the HF model's
    ``state_dict`` order (deterministic), for refit and export.

    Tensors are gathered over TP (``all_gather``) and broadcast from the owning pipeline stage
    to the whole PP group, so **every rank must consume the iterator to the end** (it runs
    collectives). Vocab padding is stripped (``vocab_size`` rows). Tied embeddings yield
    ``model.embed_tokens.weight`` and no ``lm_head.weight``. Each tensor is a new, contiguous
    tensor with the parameter's dtype, on the parameter's device.

    Raises ``RuntimeError`` if no stage owns an HF tensor or a shape differs from the HF
    model's (a conversion bug or an ``arch`` that does not match the chunks).
    """
    chunks = unwrap_model(list(model_chunks))
    owned: dict[str, _Binding] = {}
    for chunk in chunks:
        for binding in _bindings(chunk, arch).values():
            if binding.export:
                owned.update({name: binding for name in binding.hf})
    device = next(chunks[0].parameters()).device
    dtypes = {name: binding.param.dtype for name, binding in owned.items()}
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    stage_dtypes = [dtypes]
    if pp > 1:
        stage_dtypes = [None] * pp
        dist.all_gather_object(stage_dtypes, dtypes, group=pp_group)
    owner = {name: (stage, dt) for stage, d in enumerate(stage_dtypes) for name, dt in d.items()}
    shapes = _hf_shapes(arch, vocab_size)
    if set(owner) != set(shapes):
        raise RuntimeError(
            f"HF tensors owned by no stage {sorted(set(shapes) - set(owner))}, "
            f"unknown to the HF model {sorted(set(owner) - set(shapes))}"
        )
    pending: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        stage, dtype = owner[name]
        if stage == pp_rank:
            if name not in pending:
                binding = owned[name]
                tensors = _to_hf(binding.layout, _gather_tp(binding), arch, vocab_size)
                pending.update(zip(binding.hf, tensors))
            tensor = pending.pop(name).contiguous()
            if tensor.shape != shape:
                raise RuntimeError(
                    f"{name}: exported shape {tuple(tensor.shape)} != HF shape {tuple(shape)}"
                )
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        if pp > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(pp_group, stage), group=pp_group)
        yield name, tensor


def load_hf_checkpoint(path: str | Path):
    """Read a Hugging Face checkpoint directory: ``(config, state_dict)``.

    ``config`` is ``transformers.AutoConfig.from_pretrained(path)``; the state dict is read
    from ``model.safetensors`` or from the shards listed in ``model.safetensors.index.json``
    (CPU tensors in the stored dtype).

    Raises ``FileNotFoundError`` naming the directory and the file when ``config.json`` or the
    safetensors files are missing (:func:`mcore_rl.config.paths.hf_checkpoint_errors`, the
    check config validation runs), ``ValueError`` when the shards do not hold exactly the
    index's names.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from mcore_rl.config.paths import hf_checkpoint_errors

    problems = hf_checkpoint_errors("hf_path", str(path))
    if problems:
        raise FileNotFoundError("; ".join(problems))
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return config, load_file(single)
    weight_map = json.loads(index.read_text())["weight_map"]
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        state_dict.update(load_file(path / shard))
    if set(state_dict) != set(weight_map):
        raise ValueError(
            f"{index}: shards hold {sorted(set(state_dict) - set(weight_map))} not in the index "
            f"and miss {sorted(set(weight_map) - set(state_dict))}"
        )
    return config, state_dict
