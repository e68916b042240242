"""Hugging Face <-> Megatron-Core weights for the decoders of :mod:`mcore_rl.megatron.model`
(Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE), in the local, torch and Transformer Engine
layer specs, at any TP/PP/VPP/EP/expert-TP layout.

HF names are those of the checkpoint files (``save_pretrained``, the Hub, vLLM's weight loader):
one tensor per expert (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``). transformers >= 5
keeps a MoE model's experts fused in memory; :func:`hf_checkpoint_state_dict` gives a model's
tensors under the checkpoint names.

Each Megatron parameter is bound to the HF tensors it is made of and a *layout* saying how
they are fused and sharded over tensor parallelism; on rank ``r`` of ``tp`` ranks (the TP
group, or for expert weights the expert-TP group):

- ``replicated``: the HF tensor itself (RMSNorm weights, the router, the shared-expert gate).
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
and never exported. Experts: with expert parallelism (EP) the rank of EP rank ``q`` holds
experts ``q * E/EP .. (q+1) * E/EP - 1`` as its local experts ``0 .. E/EP - 1``.

Parameter names per layer spec (:func:`megatron_to_hf_names` maps names only, so the TE table
is tested on CPU without TE): the local and torch specs have a module per norm; the TE spec
fuses the norm before a linear into it (``input_layernorm.weight`` ->
``self_attention.linear_qkv.layer_norm_weight``; for a dense MLP ``pre_mlp_layernorm.weight``
-> ``mlp.linear_fc1.layer_norm_weight``, while an MoE layer keeps its norm) and keeps the
experts of a rank in one grouped linear (``mlp.experts.local_experts.{k}.linear_fc1.weight`` ->
``mlp.experts.linear_fc1.weight{k}``). These are the names of Megatron's own
``sharded_state_dict_keys_map`` of the local spec and of ``TEGroupedMLP``.

megatron-bridge (``megatron.bridge.AutoBridge``, NVIDIA's converter for many more
architectures) is used instead of these tables when it imports (it needs Transformer Engine):
:func:`load_hf_weights` of a checkpoint read by :func:`load_hf_checkpoint` and
:func:`export_hf_weights` then call ``AutoBridge.load_hf_weights`` and
``AutoBridge.export_hf_weights``, behind the same signatures.
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

from mcore_rl.config.families import FAMILIES, arch_errors, head_dim
from mcore_rl.config.schema import ModelArchConfig

_REPLICATED, _ROW, _VOCAB, _QKV, _GATE_UP = "replicated", "row", "vocab", "qkv", "gate_up"
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"
# HF rope_type "llama3" with the frequency bands Megatron-Core builds (its _apply_scaling).
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class _Rule:
    megatron: tuple[str, ...]  # the parameter's names in the layer specs (relative to the layer)
    hf: tuple[str, ...]  # HF names (relative to "model.layers.{i}." for layer rules)
    layout: str
    expert: bool = False  # sharded over the expert-TP group instead of the TP group


def _rule(megatron: str | tuple[str, ...], hf, layout: str, expert: bool = False) -> _Rule:
    names = (megatron,) if isinstance(megatron, str) else megatron
    return _Rule(names, (hf,) if isinstance(hf, str) else tuple(hf), layout, expert)


_EMBEDDING_RULE = _rule("embedding.word_embeddings.weight", _EMBED, _VOCAB)
_FINAL_NORM_RULE = _rule("decoder.final_layernorm.weight", "model.norm.weight", _REPLICATED)
_OUTPUT_RULE = _rule("output_layer.weight", _LM_HEAD, _VOCAB)
_TIED_OUTPUT_RULE = _rule("output_layer.weight", _EMBED, _VOCAB)


def _gate_up_down(megatron_fc1, megatron_fc2, hf_prefix: str, expert: bool = False):
    return [
        _rule(megatron_fc1, (f"{hf_prefix}gate_proj.weight", f"{hf_prefix}up_proj.weight"),
              _GATE_UP, expert),
        _rule(megatron_fc2, f"{hf_prefix}down_proj.weight", _ROW, expert),
    ]


def _layer_rules(arch: ModelArchConfig, ep_rank: int, ep_size: int) -> list[_Rule]:
    """The rules of one decoder layer on EP rank ``ep_rank`` of ``ep_size``."""
    family = FAMILIES[arch.family]
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    rules = [
        _rule(("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
              "input_layernorm.weight", _REPLICATED),
        _rule("self_attention.linear_qkv.weight", [f"{n}.weight" for n in qkv], _QKV),
        _rule("self_attention.linear_proj.weight", "self_attn.o_proj.weight", _ROW),
    ]
    if family.qkv_bias:
        rules.append(_rule("self_attention.linear_qkv.bias", [f"{n}.bias" for n in qkv], _QKV))
    if family.qk_layernorm:
        rules += [_rule(f"self_attention.{x}_layernorm.weight", f"self_attn.{x}_norm.weight",
                        _REPLICATED) for x in "qk"]
    if not family.moe:
        return rules + [
            _rule(("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                  "post_attention_layernorm.weight", _REPLICATED),
            *_gate_up_down("mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp."),
        ]
    rules += [
        _rule("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", _REPLICATED),
        _rule("mlp.router.weight", "mlp.gate.weight", _REPLICATED),
    ]
    local = arch.num_experts // ep_size
    for k in range(local):
        rules += _gate_up_down(
            (f"mlp.experts.local_experts.{k}.linear_fc1.weight", f"mlp.experts.linear_fc1.weight{k}"),
            (f"mlp.experts.local_experts.{k}.linear_fc2.weight", f"mlp.experts.linear_fc2.weight{k}"),
            f"mlp.experts.{ep_rank * local + k}.", expert=True)
    if family.shared_expert:
        rules += _gate_up_down("mlp.shared_experts.linear_fc1.weight",
                               "mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.")
        rules.append(_rule("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight",
                           _REPLICATED))
    return rules


@dataclass
class _Binding:
    param: torch.nn.Parameter
    hf: tuple[str, ...]  # full HF names
    layout: str
    expert: bool
    export: bool  # False for the last stage's copy of tied embeddings


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def hf_config_to_arch(hf_config) -> ModelArchConfig:
    """``ModelArchConfig`` of a Hugging Face config of a family in
    :data:`~mcore_rl.megatron.model.FAMILIES` (``model_type`` llama, mistral, qwen2, qwen3,
    qwen2_moe, qwen3_moe).

    ``qkv_bias`` is the family's. Raises ``ValueError`` naming the config field for what the
    Megatron model here does not reproduce: another ``model_type``, an activation other than
    SiLU, RoPE scaling other than none or ``llama3`` with Megatron's frequency bands (low 1,
    high 4, original context 8192), sliding-window attention, attention biases beyond the
    family's (Llama's and Qwen3's ``attention_bias`` bias o_proj too), Llama's ``mlp_bias``,
    MoE layers that are not every layer (``decoder_sparse_step``, ``mlp_only_layers``).
    """
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"config model_type={family!r} is not supported (one of "
                         f"{', '.join(FAMILIES)})")

    def unsupported(field: str, value, why: str):
        raise ValueError(f"{family} config field {field}={value!r} is not supported: {why}")

    if hf_config.hidden_act != "silu":
        unsupported("hidden_act", hf_config.hidden_act, "the MLP is SwiGLU (silu)")
    rope = getattr(hf_config, "rope_parameters", None)
    if rope is None:  # transformers 4.x: rope_theta and rope_scaling are separate fields
        rope = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", hf_config.rope_theta)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        unsupported("rope_parameters.rope_type", rope_type, "RoPE is unscaled or llama3-scaled")
    if rope_type == "llama3":
        for name, value in _LLAMA3_ROPE.items():
            if float(rope.get(name, value)) != value:
                unsupported(f"rope_parameters.{name}", rope.get(name),
                            f"Megatron-Core's llama3 RoPE scaling has {name}={value:g}")
    heads = hf_config.num_attention_heads
    head = getattr(hf_config, "head_dim", None)
    if head is None and hf_config.hidden_size % heads:
        unsupported("num_attention_heads", heads, "hidden_size must be a multiple of it "
                    "when head_dim is not set")
    if getattr(hf_config, "attention_bias", False):
        unsupported("attention_bias", True, "it also biases o_proj")
    if getattr(hf_config, "mlp_bias", False):
        unsupported("mlp_bias", True, "the MLP has no bias")
    if getattr(hf_config, "use_sliding_window", False):
        unsupported("use_sliding_window", True, "sliding-window attention is not built")
    if family == "mistral" and hf_config.sliding_window is not None:
        unsupported("sliding_window", hf_config.sliding_window,
                    "sliding-window attention is not built (a window as long as every sequence "
                    "changes nothing: set it to null in config.json if data.max_total_length is "
                    "at most the window)")
    layer_types = getattr(hf_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        unsupported("layer_types", layer_types, "every layer must be full_attention")
    moe = {}
    if FAMILIES[family].moe:
        if getattr(hf_config, "decoder_sparse_step", 1) != 1:
            unsupported("decoder_sparse_step", hf_config.decoder_sparse_step,
                        "every layer must be an MoE layer")
        if getattr(hf_config, "mlp_only_layers", None):
            unsupported("mlp_only_layers", hf_config.mlp_only_layers,
                        "every layer must be an MoE layer")
        if not getattr(hf_config, "qkv_bias", True):
            unsupported("qkv_bias", False, "qwen2_moe has q/k/v biases")
        moe = dict(
            num_experts=hf_config.num_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_norm_topk_prob=bool(hf_config.norm_topk_prob),
            moe_shared_expert_ffn_hidden_size=getattr(
                hf_config, "shared_expert_intermediate_size", None),
        )
    arch = ModelArchConfig(
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head if head is not None and head * heads != hf_config.hidden_size else None,
        ffn_hidden_size=hf_config.intermediate_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rope_theta=float(rope["rope_theta"]),
        rope_scaling_factor=float(rope["factor"]) if rope_type == "llama3" else None,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=FAMILIES[family].qkv_bias,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        vocab_size=hf_config.vocab_size,
        **moe,
    )
    errors = arch_errors(arch)
    if errors:
        raise ValueError(f"{family} config: " + "; ".join(errors))
    return arch


def arch_to_hf_config(arch: ModelArchConfig, vocab_size: int):
    """The Hugging Face config (fp32) of ``arch`` with ``vocab_size`` rows (unpadded), of the
    class of ``arch.family`` (``AutoConfig.for_model``), naming the family's causal-LM class in
    ``architectures`` as ``save_pretrained`` does (vLLM and megatron-bridge pick the model by
    it). Token ids (bos/eos/pad) are left unset: they belong to the tokenizer.

    Raises ``ValueError`` naming ``model.arch.*`` for what
    :func:`~mcore_rl.megatron.model.arch_errors` reports (an unknown family, a ``qkv_bias`` the
    family cannot express, MoE keys that do not fit the family).
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    errors = arch_errors(arch)
    if errors:
        raise ValueError("; ".join(errors))
    rope = {"rope_type": "default", "rope_theta": arch.rope_theta}
    if arch.rope_scaling_factor is not None:
        rope = {**rope, "rope_type": "llama3", "factor": arch.rope_scaling_factor, **_LLAMA3_ROPE}
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups,
        head_dim=head_dim(arch),
        hidden_act="silu",
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype="float32",
        architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch.family]],
    )
    # transformers >= 5 reads RoPE from rope_parameters, 4.x from rope_theta and rope_scaling.
    if "rope_parameters" in AutoConfig.for_model(arch.family).to_dict():
        fields["rope_parameters"] = rope
    elif arch.rope_scaling_factor is not None:
        fields["rope_scaling"] = rope
    if arch.family in ("llama", "qwen3", "qwen3_moe"):
        fields.update(attention_bias=False)
    if arch.family == "llama":
        fields.update(mlp_bias=False)
    if arch.family.startswith("qwen"):
        fields.update(use_sliding_window=False)
    if arch.family == "mistral":
        fields.update(sliding_window=None)
    if arch.num_experts is not None:
        fields.update(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.moe_router_topk,
            moe_intermediate_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
            norm_topk_prob=arch.moe_norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if arch.moe_shared_expert_ffn_hidden_size is not None:
            fields.update(shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size)
    return AutoConfig.for_model(arch.family, **fields)


def hf_checkpoint_state_dict(model) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` of a transformers model under the names and shapes its checkpoint
    files have (what ``save_pretrained`` writes and :func:`load_hf_weights` reads): transformers
    >= 5 keeps MoE experts fused in memory and reverts that on saving (its
    ``revert_weight_conversion``); for a dense model, or under transformers 4, this is the
    state dict itself. Tensors may be views of the model's parameters."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: in-memory names are the checkpoint's
        return model.state_dict()
    return dict(revert_weight_conversion(model, model.state_dict()))


def _hf_shapes(arch: ModelArchConfig, vocab_size: int) -> dict[str, torch.Size]:
    """HF checkpoint tensor names (in the order ``save_pretrained`` writes them) and shapes,
    read from a ``transformers`` model built on the meta device; ``lm_head.weight`` dropped
    when tied."""
    key = tuple(getattr(arch, f.name) for f in dataclasses.fields(ModelArchConfig))
    return dict(_hf_shapes_cached(key, vocab_size))


@functools.lru_cache(maxsize=64)
def _hf_shapes_cached(arch_key: tuple, vocab_size: int) -> tuple:
    from transformers import AutoModelForCausalLM

    arch = ModelArchConfig(*arch_key)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(arch_to_hf_config(arch, vocab_size))
    shapes = {name: t.shape for name, t in hf_checkpoint_state_dict(model).items()}
    if arch.tie_word_embeddings:
        shapes.pop(_LM_HEAD, None)
    return tuple(shapes.items())


class SeededNormalInit(Mapping):
    """A random initial state under the HF checkpoint names whose tensors are drawn when read,
    on ``device``, each from a generator of its own: ``model.init=normal`` (a model too large
    to initialise as a transformers model on the host, e.g. an 8B shape without a checkpoint).

    The distribution is transformers' ``_init_weights`` of the decoders converted here (Llama,
    Qwen2/3, Mistral): every weight of a linear layer and of the embedding
    ``N(0, std^2)`` with ``std`` the config's ``initializer_range``; RMSNorm weights (``*norm*``)
    1; biases 0. Tensor ``name`` is drawn by a ``torch.Generator`` on ``device`` seeded with
    ``crc32(f"{seed}:{name}")``, in float32, so it does not depend on the order the tensors are
    read in, on the TP/PP/DP layout (every rank draws the full tensor and keeps its slice), or
    on which other tensors are read: every layout of one device type starts from the same
    weights. CPU and CUDA generators give different numbers for one seed.

    :func:`load_hf_weights` reads it without materialising the whole model (each tensor is
    drawn when its parameter is loaded, then dropped). ``shape(name)`` gives a shape without
    drawing.

    Args:
        arch: the model shape (``model.arch``).
        vocab_size: embedding rows.
        seed: ``run.seed``.
        std: the normal's standard deviation (transformers' ``initializer_range``, 0.02 for
            these families).
        device: where tensors are drawn (the worker's device).
    """

    def __init__(self, arch: ModelArchConfig, vocab_size: int, seed: int, std: float = 0.02,
                 device: torch.device | str = "cpu"):
        self._shapes = _hf_shapes(arch, vocab_size)
        self.seed, self.std, self.device = int(seed), float(std), torch.device(device)

    def shape(self, name: str) -> torch.Size:
        """The HF checkpoint shape of ``name`` (``KeyError`` if the model has none)."""
        return self._shapes[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        import zlib

        shape = self._shapes[name]
        if name.endswith(".bias"):
            return torch.zeros(shape, device=self.device)
        if "norm" in name.rsplit(".", 2)[-2]:  # input_layernorm, q_norm, model.norm, ...
            return torch.ones(shape, device=self.device)
        g = torch.Generator(device=self.device)
        g.manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
        return torch.empty(shape, device=self.device).normal_(0.0, self.std, generator=g)

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int):
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, arch: ModelArchConfig) -> list[torch.Tensor]:
    groups, heads, dim = arch.num_query_groups, arch.num_attention_heads, head_dim(arch)
    rest = qkv.shape[1:]
    sizes = [heads // groups * dim, dim, dim]
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


def _tp(expert: bool) -> tuple[int, int, object]:
    """``(size, rank, group)`` of the TP group, or of the expert-TP group for expert weights."""
    ps = parallel_state
    if expert:
        return (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def megatron_to_hf_names(
    param_names: Iterable[str],
    arch: ModelArchConfig,
    *,
    layer_numbers: list[int],
    pre_process: bool,
    post_process: bool,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, tuple[tuple[str, ...], str, bool, bool]]:
    """Bind the parameter names of one ``GPTModel`` chunk (any layer spec) to HF names.

    Args:
        param_names: the chunk's ``named_parameters()`` names (``decoder.layers.{j}.…``).
        arch: the model shape.
        layer_numbers: Megatron's ``layer_number`` (1-based, global) of ``decoder.layers[j]``.
        pre_process, post_process: the chunk holds the embedding / the final norm and output.
        ep_rank, ep_size: this rank's expert-parallel coordinates (its local experts).

    Returns:
        ``{megatron name: (full HF names, layout, expert, export)}`` in the chunk's order of
        rules; ``export`` is False for the last stage's copy of tied embeddings.

    Raises:
        ValueError: parameters without a rule (another layer spec or an architecture feature the
            tables do not cover) or rules without a parameter, both listed.
    """
    names = list(param_names)
    present = set(names)
    wanted: dict[str, tuple[tuple[str, ...], str, bool, bool]] = {}
    absent: list[str] = []

    def bind(rule: _Rule, prefix: str, hf_prefix: str, export: bool = True) -> None:
        found = [prefix + m for m in rule.megatron if prefix + m in present]
        if not found:
            absent.append(prefix + rule.megatron[0])
            return
        wanted[found[0]] = (tuple(hf_prefix + h for h in rule.hf), rule.layout, rule.expert,
                            export)

    if pre_process:
        bind(_EMBEDDING_RULE, "", "")
    layer_rules = _layer_rules(arch, ep_rank, ep_size)
    for j, number in enumerate(layer_numbers):
        for rule in layer_rules:
            bind(rule, f"decoder.layers.{j}.", f"model.layers.{number - 1}.")
    if post_process:
        bind(_FINAL_NORM_RULE, "", "")
        if _OUTPUT_RULE.megatron[0] in present:  # absent when tied on a stage with the embedding
            tied = arch.tie_word_embeddings
            bind(_TIED_OUTPUT_RULE if tied else _OUTPUT_RULE, "", "", export=not tied)
    unbound = sorted(present - set(wanted))
    if absent or unbound:
        raise ValueError(
            f"Megatron chunk and {arch.family} conversion rules disagree: parameters without a "
            f"rule {unbound}, rules without a parameter {absent} (check model.arch against "
            f"the built model)"
        )
    return {name: wanted[name] for name in names}


def _bindings(chunk, arch: ModelArchConfig) -> dict[str, _Binding]:
    """Every parameter of one (unwrapped) ``GPTModel`` chunk, bound to its HF tensors
    (:func:`megatron_to_hf_names`, which raises ``ValueError``)."""
    params = dict(chunk.named_parameters())
    names = megatron_to_hf_names(
        params, arch, layer_numbers=[layer.layer_number for layer in chunk.decoder.layers],
        pre_process=chunk.pre_process, post_process=chunk.post_process,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size())
    return {name: _Binding(params[name], *bound) for name, bound in names.items()}


# ---------------------------------------------------------------------------------------------
# megatron-bridge
# ---------------------------------------------------------------------------------------------


def _auto_bridge():
    """``megatron.bridge.AutoBridge`` when megatron-bridge imports (it needs Transformer
    Engine), else None."""
    try:
        from megatron.bridge import AutoBridge
    except ImportError:
        return None
    return AutoBridge


class HFCheckpointState(dict):
    """A Hugging Face state dict read by :func:`load_hf_checkpoint` that remembers its
    directory (``path``), so that :func:`load_hf_weights` can hand the checkpoint to
    megatron-bridge, which reads the files itself."""

    path: Path


# ---------------------------------------------------------------------------------------------
# Import / export
# ---------------------------------------------------------------------------------------------


def load_hf_weights(
    model_chunks: Iterable[torch.nn.Module],
    hf_state_dict: Mapping[str, torch.Tensor],
    arch: ModelArchConfig,
) -> None:
    """Copy HF-named full tensors into this rank's Megatron chunks (any TP/PP/VPP/EP layout).

    Args:
        model_chunks: this rank's chunks from :func:`mcore_rl.megatron.model.build_model`,
            bare or wrapped (Megatron DDP / ``Float16Module``). Load before building the
            optimizer: its fp32 main params are copies made at construction.
        hf_state_dict: the whole model's tensors by HF checkpoint name (every rank passes all
            of them; each copies its own slice; :func:`hf_checkpoint_state_dict` of a
            transformers model). A tied ``lm_head.weight`` may be present if it equals
            ``model.embed_tokens.weight``. Any dtype; values are cast to the param dtype. A
            :class:`HFCheckpointState` (from :func:`load_hf_checkpoint`) is loaded by
            megatron-bridge's ``AutoBridge.load_hf_weights`` from its files when megatron-bridge
            imports; a :class:`SeededNormalInit` is drawn tensor by tensor on its device as the
            parameters are loaded (never the whole model at once).
        arch: the model shape; ``arch.vocab_size`` (if set) must equal the embedding rows.

    Vocab pad rows (``>= vocab_size``) are set to zero.

    Raises ``ValueError`` listing missing and unexpected HF names, wrong shapes, a tied
    ``lm_head.weight`` that differs from the embedding, or Megatron parameters that no rule
    writes (each parameter is written exactly once).
    """
    chunks = unwrap_model(list(model_chunks))
    bridge = _auto_bridge()
    if bridge is not None and isinstance(hf_state_dict, HFCheckpointState):
        from transformers import AutoConfig

        path = str(hf_state_dict.path)
        bridge.from_hf_config(AutoConfig.from_pretrained(path)).load_hf_weights(chunks, hf_path=path)
        return
    lazy = isinstance(hf_state_dict, SeededNormalInit)  # tensors drawn when read: no dict
    hf = hf_state_dict if lazy else dict(hf_state_dict)
    shape_of = hf.shape if lazy else (lambda n: hf[n].shape)
    if _EMBED not in hf:
        raise ValueError(f"HF state dict has no {_EMBED}")
    vocab_size = shape_of(_EMBED)[0]
    if arch.vocab_size is not None and arch.vocab_size != vocab_size:
        raise ValueError(
            f"model.arch.vocab_size={arch.vocab_size} but {_EMBED} has {vocab_size} rows"
        )
    if arch.tie_word_embeddings and _LM_HEAD in hf and not lazy:
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
    wrong = {n: (tuple(shape_of(n)), tuple(s)) for n, s in shapes.items() if shape_of(n) != s}
    if wrong:
        raise ValueError(f"HF tensor shapes (got, expected from model.arch): {wrong}")
    for index, chunk in enumerate(chunks):
        for name, binding in _bindings(chunk, arch).items():
            param = binding.param
            tp, rank, _ = _tp(binding.expert)
            source = [hf[n].to(param.device) for n in binding.hf]
            local = _to_local(binding.layout, source, arch, tp, rank, param.shape[0] * tp)
            if local.shape != param.shape:
                raise ValueError(
                    f"chunk {index} {name}: converted shape {tuple(local.shape)} from "
                    f"{binding.hf} differs from the Megatron parameter {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(local)


def _gather_tp(binding: _Binding) -> list[torch.Tensor]:
    local = binding.param.detach()
    tp, _, group = _tp(binding.expert)
    if binding.layout == _REPLICATED or tp == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def _owners(dtypes: dict[str, torch.dtype], group, size: int) -> list[dict[str, torch.dtype]]:
    """Every rank's ``{HF name: dtype}`` of a group (``all_gather_object``), index = group rank."""
    if size == 1:
        return [dtypes]
    out = [None] * size
    dist.all_gather_object(out, dtypes, group=group)
    return out


@torch.no_grad()
def export_hf_weights(
    model_chunks: Iterable[torch.nn.Module],
    arch: ModelArchConfig,
    vocab_size: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model on every rank, under the HF
    checkpoint names in the order ``save_pretrained`` writes them (deterministic), for refit
    and export.

    Tensors are gathered over TP (``all_gather``; expert weights over expert TP), broadcast
    from the EP rank that holds an expert to its expert-parallel group, and from the owning
    pipeline stage to the whole PP group, so **every rank must consume the iterator to the
    end** (it runs collectives). Vocab padding is stripped (``vocab_size`` rows). Tied
    embeddings yield ``model.embed_tokens.weight`` and no ``lm_head.weight``. Each tensor is a
    new, contiguous tensor with the parameter's dtype, on the parameter's device. When
    megatron-bridge imports, ``AutoBridge.export_hf_weights`` of the same model yields them
    instead (in its own order).

    Raises ``RuntimeError`` if no rank owns an HF tensor or a shape differs from the HF
    model's (a conversion bug or an ``arch`` that does not match the chunks).
    """
    chunks = unwrap_model(list(model_chunks))
    bridge = _auto_bridge()
    if bridge is not None:
        hf_config = arch_to_hf_config(arch, vocab_size)
        yield from bridge.from_hf_config(hf_config).export_hf_weights(chunks, show_progress=False)
        return
    owned: dict[str, _Binding] = {}
    for chunk in chunks:
        for binding in _bindings(chunk, arch).values():
            if binding.export:
                owned.update({name: binding for name in binding.hf})
    device = next(chunks[0].parameters()).device
    dtypes = {name: binding.param.dtype for name, binding in owned.items()}
    ps = parallel_state
    ep, ep_group = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group()
    pp, pp_group = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group()
    ep_rank, pp_rank = ps.get_expert_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    # Expert tensors live on one EP rank of a stage, the others on all of them.
    ep_dtypes = _owners(dtypes, ep_group, ep)
    stage_names = {n: dt for d in ep_dtypes for n, dt in d.items()}
    holders = {name: [q for q in range(ep) if name in ep_dtypes[q]] for name in stage_names}
    expert_owner = {name: q[0] for name, q in holders.items() if len(q) < ep}
    stage_dtypes = _owners(stage_names, pp_group, pp)
    owner = {name: (stage, dt) for stage, d in enumerate(stage_dtypes) for name, dt in d.items()}
    stage_experts = _owners(expert_owner, pp_group, pp)
    shapes = _hf_shapes(arch, vocab_size)
    if set(owner) != set(shapes):
        raise RuntimeError(
            f"HF tensors owned by no rank {sorted(set(shapes) - set(owner))}, "
            f"unknown to the HF model {sorted(set(owner) - set(shapes))}"
        )
    pending: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        stage, dtype = owner[name]
        expert_rank = stage_experts[stage].get(name)
        if stage == pp_rank and expert_rank in (None, ep_rank):
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
        if stage == pp_rank and expert_rank is not None:
            dist.broadcast(tensor, src=dist.get_global_rank(ep_group, expert_rank), group=ep_group)
        if pp > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(pp_group, stage), group=pp_group)
        yield name, tensor


def load_hf_checkpoint(path: str | Path):
    """Read a Hugging Face checkpoint directory: ``(config, state_dict)``.

    ``config`` is ``transformers.AutoConfig.from_pretrained(path)``; the state dict (a
    :class:`HFCheckpointState` that remembers ``path``) is read from ``model.safetensors`` or
    from the shards listed in ``model.safetensors.index.json`` (CPU tensors in the stored dtype,
    checkpoint names).

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
    state = HFCheckpointState()
    state.path = path
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        state.update(load_file(single))
        return config, state
    weight_map = json.loads(index.read_text())["weight_map"]
    for shard in sorted(set(weight_map.values())):
        state.update(load_file(path / shard))
    if set(state) != set(weight_map):
        raise ValueError(
            f"{index}: shards hold {sorted(set(state) - set(weight_map))} not in the index "
            f"and miss {sorted(set(weight_map) - set(state))}"
        )
    return config, state
