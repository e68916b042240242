"""HF <-> Megatron conversion against Hugging Face itself: tiny Llama, Llama 3 (llama3 RoPE
scaling), Mistral, Qwen2, Qwen3 (query/key norm, head_dim != hidden / heads), Qwen3-MoE and
Qwen2-MoE (shared expert with its sigmoid gate) models from ``transformers`` are converted into
Megatron (TP=1, TP=2, PP=2, PP=2 x VPP=2, and for the MoE models EP=2, EP=2 x TP=2, expert
TP=2 and the allgather token dispatcher, over 2 gloo processes spawned once for the module),
logits are compared with the HF forward, and the export must give back the HF checkpoint
tensors bit for bit, in the order ``save_pretrained`` writes them, on every rank."""

from __future__ import annotations

import sys

import pytest
import torch
from dist_utils import run_distributed, use_layout
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from mcore_rl.config.schema import MegatronConfig, ModelArchConfig
from mcore_rl.megatron.conversion import (
    SeededNormalInit,
    arch_to_hf_config,
    export_hf_weights,
    hf_checkpoint_state_dict,
    hf_config_to_arch,
    load_hf_checkpoint,
    load_hf_weights,
)
from mcore_rl.megatron.model import (
    build_model,
    causal_attention_mask,
    padded_vocab_size,
    position_ids,
)

# Llama 3.x RoPE (Llama 3.2's factor); theta 5e5 puts several frequencies in the scaled bands.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# name: (config class, vocab, layers, kv heads, tied, extra config fields)
MODELS = {
    "llama": (LlamaConfig, 100, 2, 2, False, {}),
    "qwen2_tied": (Qwen2Config, 100, 2, 2, True, {}),
    "qwen2_untied": (Qwen2Config, 100, 2, 2, False, {}),
    "qwen2_tied_v101": (Qwen2Config, 101, 2, 2, True, {}),
    "llama_mqa_v101": (LlamaConfig, 101, 2, 1, False, {"rope_theta": 5e5}),
    "llama_4_layers": (LlamaConfig, 100, 4, 2, False, {}),
    "qwen2_tied_4_layers": (Qwen2Config, 100, 4, 2, True, {}),
    "qwen3_tied": (Qwen3Config, 100, 2, 2, True, {"head_dim": 32}),
    "llama3_scaled": (LlamaConfig, 101, 2, 2, False, {"rope_parameters": LLAMA3_ROPE}),
    "mistral": (MistralConfig, 100, 2, 1, False, {"sliding_window": None}),
    "qwen3_moe": (Qwen3MoeConfig, 100, 2, 2, False, {**MOE, "head_dim": 32, "norm_topk_prob": True}),
    "qwen2_moe_tied_v101": (Qwen2MoeConfig, 101, 2, 2, True,
                            {**MOE, "shared_expert_intermediate_size": 48}),
}
MOE_MODELS = ("qwen3_moe", "qwen2_moe_tied_v101")
# (layout name, policy.megatron fields, models)
LAYOUTS = [
    ("tp1", {}, ("llama", "qwen2_tied", "qwen2_untied", "qwen3_tied", "llama3_scaled", "mistral",
                 *MOE_MODELS)),
    ("tp2", dict(tensor_model_parallel_size=2), ("qwen2_tied_v101", "llama_mqa_v101",
                                                 "qwen3_tied", "llama3_scaled", "mistral")),
    ("pp2", dict(pipeline_model_parallel_size=2), ("qwen2_tied", "llama", "qwen3_tied",
                                                    "llama3_scaled", "mistral", *MOE_MODELS)),
    ("pp2_vpp2", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
     ("llama_4_layers", "qwen2_tied_4_layers")),
    ("ep2", dict(expert_model_parallel_size=2), MOE_MODELS),
    # MoE with TP needs sequence parallelism; the experts whole on each rank (expert TP 1) ...
    ("ep2_tp2", dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                     expert_tensor_parallel_size=1, sequence_parallel=True), MOE_MODELS),
    # ... or split over expert TP = 2
    ("tp2_etp2", dict(tensor_model_parallel_size=2, sequence_parallel=True), MOE_MODELS),
    ("ep2_allgather", dict(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather"),
     MOE_MODELS),
]
CASES = [(layout, name) for layout, _, names in LAYOUTS for name in names]
BATCH, SEQ = 4, 12


def hf_model(name: str):
    """A seeded tiny HF model whose every tensor (norms and biases too) is random, so a
    swapped or misplaced tensor changes the logits."""
    cls, vocab, layers, kv_heads, tied, extra = MODELS[name]
    config = cls(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, attn_implementation="eager", **extra,
    )
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if "embed" in pname else 0.15)
    return model


def _megatron_logits(chunks, ids: torch.Tensor, vocab: int):
    """Logits [b, s, vocab] through Megatron's own schedule (PP/VPP p2p), last stage only."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(data_iterator, model):
        x = next(data_iterator)
        out = model(x, position_ids(1, SEQ), causal_attention_mask(1, SEQ, "cpu"),
                    runtime_gather_output=True)
        return out, None

    iterators = [iter(ids.split(1)) for _ in chunks]
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks, num_microbatches=BATCH, seq_length=SEQ, micro_batch_size=1,
            forward_only=True,
        )
    return torch.cat(out)[..., :vocab] if out else None


def _check(name, megatron: MegatronConfig):
    from megatron.core import parallel_state

    tp = megatron.tensor_model_parallel_size
    model = hf_model(name)
    arch = hf_config_to_arch(model.config)
    vocab = arch.vocab_size
    chunks = build_model(arch, megatron, vocab, "cpu")
    state = hf_checkpoint_state_dict(model)
    load_hf_weights(chunks, state, arch)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
    logits = _megatron_logits(chunks, ids, vocab)
    expected = {k: v for k, v in state.items()
                if not (arch.tie_word_embeddings and k == "lm_head.weight")}
    exported = list(export_hf_weights(chunks, arch, vocab))
    pad_rows = [
        c.embedding.word_embeddings.weight[-(padded_vocab_size(vocab, tp) - vocab):]
        for c in chunks
        if c.pre_process and parallel_state.get_tensor_model_parallel_rank() == tp - 1
        and padded_vocab_size(vocab, tp) > vocab
    ]
    return {
        "max_diff": None if logits is None else (logits - reference).abs().max().item(),
        "logit_std": reference.std().item(),
        "exported_names": [n for n, _ in exported],
        "expected_names": list(expected),
        "not_equal": [n for n, t in exported if not torch.equal(t, expected[n])],
        "pad_rows_abs_max": [r.abs().max().item() for r in pad_rows],
    }


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _error_checks():
    """Bad inputs to load_hf_weights (TP=1, PP=1): each message must name the culprit."""
    model = hf_model("qwen2_untied")
    arch = hf_config_to_arch(model.config)
    chunks = build_model(arch, MegatronConfig(), arch.vocab_size, "cpu")
    good = model.state_dict()
    missing = {k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"}
    extra = {**good, "model.layers.7.mlp.up_proj.weight": torch.zeros(3)}
    shape = {**good, "model.norm.weight": torch.ones(65)}
    tied = hf_model("qwen2_tied")
    tied_sd = {**tied.state_dict(), "lm_head.weight": torch.zeros(100, 64)}
    tied_arch = hf_config_to_arch(tied.config)
    # A Llama state dict (no QKV bias) into the Qwen2 chunks: linear_qkv.bias has no rule.
    llama = hf_model("llama")
    llama_arch = hf_config_to_arch(llama.config)
    return {
        "missing": _error(lambda: load_hf_weights(chunks, missing, arch)),
        "extra": _error(lambda: load_hf_weights(chunks, extra, arch)),
        "shape": _error(lambda: load_hf_weights(chunks, shape, arch)),
        "tied": _error(lambda: load_hf_weights(build_model(
            tied_arch, MegatronConfig(), 100, "cpu"), tied_sd, tied_arch)),
        "unbound": _error(lambda: load_hf_weights(chunks, llama.state_dict(), llama_arch)),
    }


SEEDED_LAYOUTS = ("tp1", "tp2", "pp2")


def _seeded_check(megatron: MegatronConfig) -> list:
    """model.init=normal in this layout: the weights exported after loading the lazily drawn
    state, against the same state drawn whole (names that differ; [] when equal bit for bit)."""
    model = hf_model("llama_mqa_v101")
    arch = hf_config_to_arch(model.config)
    chunks = build_model(arch, megatron, arch.vocab_size, "cpu")
    load_hf_weights(chunks, SeededNormalInit(arch, arch.vocab_size, seed=5), arch)
    drawn = dict(SeededNormalInit(arch, arch.vocab_size, seed=5))
    exported = dict(export_hf_weights(chunks, arch, arch.vocab_size))
    assert set(exported) == set(drawn)
    return [n for n, t in exported.items() if not torch.equal(t, drawn[n])]


def _all_checks():
    results = {}
    for layout, fields, names in LAYOUTS:
        megatron = MegatronConfig(**fields)
        use_layout(megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                   megatron.virtual_pipeline_model_parallel_size,
                   expert_model_parallel_size=megatron.expert_model_parallel_size,
                   expert_tensor_parallel_size=megatron.expert_tensor_parallel_size)
        for name in names:
            results[(layout, name)] = _check(name, megatron)
        if layout in SEEDED_LAYOUTS:
            results[("seeded", layout)] = _seeded_check(megatron)
        if layout == "tp1":
            results["errors"] = _error_checks()
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_checks, 2)


@pytest.mark.parametrize("layout", SEEDED_LAYOUTS)
def test_seeded_normal_init_loads_the_same_weights_in_every_layout(results, layout):
    """model.init=normal: each rank draws every tensor it loads and keeps its slice; the
    exported model is the whole drawn state, bit for bit, at TP=1, TP=2 and PP=2."""
    assert [r[("seeded", layout)] for r in results] == [[], []]  # every rank exports it all


def test_seeded_normal_init_draws_each_tensor_from_its_own_seed():
    arch = hf_config_to_arch(hf_model("qwen2_tied").config)
    state = SeededNormalInit(arch, arch.vocab_size, seed=3, std=0.02)
    names = list(state)
    assert len(state) == len(names) and "lm_head.weight" not in names  # tied
    forward = {n: state[n] for n in names}
    backward = {n: state[n] for n in reversed(names)}
    assert all(torch.equal(forward[n], backward[n]) for n in names)  # read order does not matter
    other = SeededNormalInit(arch, arch.vocab_size, seed=4)
    emb = "model.embed_tokens.weight"
    assert not torch.equal(other[emb], forward[emb])
    assert state.shape(emb) == forward[emb].shape == (arch.vocab_size, arch.hidden_size)
    for n, t in forward.items():  # transformers' _init_weights for these decoders
        if n.endswith(".bias"):
            assert not t.any(), n
        elif "norm" in n:
            assert torch.equal(t, torch.ones_like(t)), n
        else:
            assert abs(t.std().item() - 0.02) < 0.2 * 0.02 and abs(t.mean().item()) < 0.01, n
    assert not torch.equal(forward["model.layers.0.mlp.up_proj.weight"][:8],
                           forward["model.layers.1.mlp.up_proj.weight"][:8])


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_logits_match_hf(results, case):
    last = [r[case] for r in results if r[case]["max_diff"] is not None]
    assert last, "no rank computed logits"
    for r in last:
        assert r["logit_std"] > 0.5  # the comparison is not between near-zero numbers
        assert r["max_diff"] < 1e-4


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_export_round_trips_bit_exactly_on_every_rank(results, case):
    for r in results:
        assert r[case]["exported_names"] == r[case]["expected_names"]  # same keys, HF order
        assert r[case]["not_equal"] == []


def test_tied_export_has_no_lm_head(results):
    for case in CASES:
        if "tied" in case[1] and "untied" not in case[1]:
            assert "lm_head.weight" not in results[0][case]["exported_names"]
    assert "lm_head.weight" in results[0][("tp1", "llama")]["exported_names"]


def test_vocab_pad_rows_are_zero(results):
    # vocab 101 at TP=2: 102 rows, the last one (on TP rank 1) is padding.
    rows = [v for r in results for v in r[("tp2", "qwen2_tied_v101")]["pad_rows_abs_max"]]
    assert rows == [0.0]


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("missing", "model.layers.1.mlp.up_proj.weight"),
        ("extra", "model.layers.7.mlp.up_proj.weight"),
        ("shape", "model.norm.weight"),
        ("tied", "lm_head.weight differs"),
        ("unbound", "decoder.layers.0.self_attention.linear_qkv.bias"),
    ],
)
def test_load_errors_name_the_tensor(results, kind, needle):
    assert needle in results[0]["errors"][kind]


# --------------------------------------------------------------------------- single process


ROUND_TRIP_ARCHS = [
    ModelArchConfig(family="qwen2", qkv_bias=True, rope_theta=5e5, vocab_size=77),
    ModelArchConfig(family="llama", qkv_bias=False, rope_theta=5e5, vocab_size=77,
                    tie_word_embeddings=False, rope_scaling_factor=8.0),
    ModelArchConfig(family="mistral", qkv_bias=False, vocab_size=77, head_dim=32),
    ModelArchConfig(family="qwen3", qkv_bias=False, vocab_size=77, head_dim=32),
    ModelArchConfig(family="qwen3_moe", qkv_bias=False, vocab_size=77, num_experts=8,
                    moe_router_topk=2, moe_ffn_hidden_size=32, moe_norm_topk_prob=True),
    ModelArchConfig(family="qwen2_moe", qkv_bias=True, vocab_size=77, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=32,
                    moe_shared_expert_ffn_hidden_size=48),
]


@pytest.mark.parametrize("arch", ROUND_TRIP_ARCHS, ids=[a.family for a in ROUND_TRIP_ARCHS])
def test_arch_hf_config_round_trip(arch):
    config = arch_to_hf_config(arch, 77)
    assert config.model_type == arch.family
    assert config.architectures == [type(AutoModelForCausalLM.from_config(config)).__name__]
    assert hf_config_to_arch(config) == arch


def test_llama3_rope_scaling_changes_the_logits():
    """The llama3 parity cases above could not tell a scaled RoPE from an unscaled one if the
    scaling did not move the logits of their 12 positions well past the 1e-4 tolerance."""
    scaled = hf_model("llama3_scaled")
    config = scaled.config.to_dict()
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
    plain = AutoModelForCausalLM.from_config(type(scaled.config).from_dict(config)).eval()
    plain.load_state_dict(scaled.state_dict())
    ids = torch.randint(0, 101, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (scaled(ids).logits - plain(ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize(
    "arch, needle",
    [
        (ModelArchConfig(family="gpt"), "model.arch.family"),
        (ModelArchConfig(family="qwen3", qkv_bias=True), "model.arch.qkv_bias"),
        (ModelArchConfig(family="qwen3_moe", qkv_bias=False), "model.arch.num_experts"),
        (ModelArchConfig(family="qwen3_moe", qkv_bias=False, num_experts=4, moe_router_topk=5),
         "model.arch.moe_router_topk"),
        (ModelArchConfig(family="qwen2_moe", num_experts=4), "moe_shared_expert_ffn_hidden_size"),
    ],
)
def test_arch_errors_name_the_key(arch, needle):
    with pytest.raises(ValueError, match=needle):
        arch_to_hf_config(arch, 10)


@pytest.mark.parametrize(
    "config, field",
    [
        (LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type"),
        (LlamaConfig(attention_bias=True), "attention_bias"),
        (LlamaConfig(mlp_bias=True), "mlp_bias"),
        (LlamaConfig(rope_parameters={**LLAMA3_ROPE, "high_freq_factor": 2.0}), "high_freq_factor"),
        (Qwen3Config(attention_bias=True), "attention_bias"),
        (MistralConfig(sliding_window=4096), "sliding_window"),
        (LlamaConfig(hidden_act="gelu"), "hidden_act"),
        (Qwen2Config(use_sliding_window=True, sliding_window=8, num_hidden_layers=2,
                     max_window_layers=1), "use_sliding_window"),
        (Qwen3MoeConfig(decoder_sparse_step=2), "decoder_sparse_step"),
        (Qwen2MoeConfig(mlp_only_layers=[0]), "mlp_only_layers"),
    ],
)
def test_unsupported_hf_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        hf_config_to_arch(config)


def test_arch_to_hf_config_refuses_llama_qkv_bias():
    with pytest.raises(ValueError, match="qkv_bias"):
        arch_to_hf_config(ModelArchConfig(family="llama", qkv_bias=True), 10)


@pytest.mark.parametrize("name, shard", [("qwen2_untied", None), ("qwen2_untied", "30KB"),
                                         ("qwen3_moe", None)])
def test_load_hf_checkpoint(tmp_path, name, shard):
    """What save_pretrained writes (one tensor per expert for the MoE models) is read back under
    the names hf_checkpoint_state_dict gives, the directory remembered for megatron-bridge."""
    model = hf_model(name)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    config, state = load_hf_checkpoint(tmp_path)
    assert hf_config_to_arch(config) == hf_config_to_arch(model.config)
    assert state.path == tmp_path
    expected = hf_checkpoint_state_dict(model)
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_load_hf_checkpoint_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)
    arch_to_hf_config(ModelArchConfig(), 10).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)


class _StandInBridge:
    """What the tests see of ``megatron.bridge.AutoBridge``: the calls it gets."""

    calls = []

    def __init__(self, config):
        self.config = config

    @classmethod
    def from_hf_config(cls, config):
        return cls(config)

    def load_hf_weights(self, model, hf_path=None):
        self.calls.append(("load", self.config, model, hf_path))

    def export_hf_weights(self, model, cpu=False, show_progress=True):
        self.calls.append(("export", self.config, model, show_progress))
        yield "model.norm.weight", torch.ones(2)


def test_megatron_bridge_is_used_when_it_imports(monkeypatch, tmp_path):
    """megatron-bridge imports Transformer Engine, so it cannot load here: a stand-in
    ``megatron.bridge`` module checks that load_hf_weights (of a checkpoint directory read by
    load_hf_checkpoint) and export_hf_weights hand the model chunks to ``AutoBridge``, built
    from the checkpoint's config or from arch_to_hf_config's (which names the architecture
    class the bridge dispatches on), and that an in-memory state dict still uses the tables."""
    import types

    monkeypatch.setitem(sys.modules, "megatron.bridge",
                        types.SimpleNamespace(AutoBridge=_StandInBridge))
    monkeypatch.setattr(_StandInBridge, "calls", [])
    hf_model("qwen3_tied").save_pretrained(tmp_path)
    _, state = load_hf_checkpoint(tmp_path)
    arch = hf_config_to_arch(AutoConfig.from_pretrained(tmp_path))
    chunk = torch.nn.Linear(2, 2)
    load_hf_weights([chunk], state, arch)
    exported = list(export_hf_weights([chunk], arch, 100))
    (load, config, model, path), (export, export_config, export_model, progress) = \
        _StandInBridge.calls
    assert (load, config.model_type, model, path) == ("load", "qwen3", [chunk], str(tmp_path))
    assert (export, export_model, progress) == ("export", [chunk], False)
    assert export_config.architectures == ["Qwen3ForCausalLM"]
    assert hf_config_to_arch(export_config) == arch
    assert [name for name, _ in exported] == ["model.norm.weight"]
    with pytest.raises(ValueError, match="no model.embed_tokens.weight"):
        load_hf_weights([chunk], {}, arch)


def test_padded_vocab_size_and_inputs():
    assert [padded_vocab_size(v, 2) for v in (100, 101)] == [100, 102]
    assert padded_vocab_size(101, 1) == 101
    mask = causal_attention_mask(2, 5, "cpu")
    reference = ~torch.ones(5, 5, dtype=torch.bool).tril()
    assert mask.shape == (2, 1, 5, 5) and torch.equal(mask[1, 0], reference)
    assert torch.equal(position_ids(2, 3), torch.tensor([[0, 1, 2], [0, 1, 2]]))
