"""HF <-> Megatron conversion against Hugging Face itself: tiny Llama/Qwen2 models from
``transformers`` are converted into Megatron (TP=1, TP=2, PP=2, PP=2 x VPP=2 over 2 gloo
processes, spawned once for the module), logits are compared with the HF forward, and the
export must give back the HF state dict bit for bit, in HF order, on every rank."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed, use_layout
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from mcore_rl.config.schema import MegatronConfig, ModelArchConfig
from mcore_rl.megatron.conversion import (
    arch_to_hf_config,
    export_hf_weights,
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

# name: (config class, vocab, layers, kv heads, tied, extra config fields)
MODELS = {
    "llama": (LlamaConfig, 100, 2, 2, False, {}),
    "qwen2_tied": (Qwen2Config, 100, 2, 2, True, {}),
    "qwen2_untied": (Qwen2Config, 100, 2, 2, False, {}),
    "qwen2_tied_v101": (Qwen2Config, 101, 2, 2, True, {}),
    "llama_mqa_v101": (LlamaConfig, 101, 2, 1, False, {"rope_theta": 5e5}),
    "llama_4_layers": (LlamaConfig, 100, 4, 2, False, {}),
    "qwen2_tied_4_layers": (Qwen2Config, 100, 4, 2, True, {}),
}
# (layout name, TP, PP, VPP, models)
LAYOUTS = [
    ("tp1", 1, 1, None, ("llama", "qwen2_tied", "qwen2_untied")),
    ("tp2", 2, 1, None, ("qwen2_tied_v101", "llama_mqa_v101")),
    ("pp2", 1, 2, None, ("qwen2_tied", "llama")),
    ("pp2_vpp2", 1, 2, 2, ("llama_4_layers", "qwen2_tied_4_layers")),
]
CASES = [(layout, name) for layout, _, _, _, names in LAYOUTS for name in names]
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


def _check(name, tp, pp, vpp):
    from megatron.core import parallel_state

    model = hf_model(name)
    arch = hf_config_to_arch(model.config)
    vocab = arch.vocab_size
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp)
    chunks = build_model(arch, megatron, vocab, "cpu")
    load_hf_weights(chunks, model.state_dict(), arch)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
    logits = _megatron_logits(chunks, ids, vocab)
    expected = {k: v for k, v in model.state_dict().items()
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


def _all_checks():
    results = {}
    for layout, tp, pp, vpp, names in LAYOUTS:
        use_layout(tp, pp, vpp)
        for name in names:
            results[(layout, name)] = _check(name, tp, pp, vpp)
        if layout == "tp1":
            results["errors"] = _error_checks()
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_checks, 2)


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


def test_arch_hf_config_round_trip():
    for family, bias in (("qwen2", True), ("llama", False)):
        arch = ModelArchConfig(family=family, qkv_bias=bias, rope_theta=5e5, vocab_size=77,
                               tie_word_embeddings=family == "qwen2")
        assert hf_config_to_arch(arch_to_hf_config(arch, 77)) == arch


@pytest.mark.parametrize(
    "config, field",
    [
        (LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type"),
        (LlamaConfig(attention_bias=True), "attention_bias"),
        (LlamaConfig(mlp_bias=True), "mlp_bias"),
        (LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32), "head_dim"),
        (LlamaConfig(hidden_act="gelu"), "hidden_act"),
        (Qwen2Config(use_sliding_window=True, sliding_window=8, num_hidden_layers=2,
                     max_window_layers=1), "use_sliding_window"),
    ],
)
def test_unsupported_hf_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        hf_config_to_arch(config)


def test_arch_to_hf_config_refuses_llama_qkv_bias():
    with pytest.raises(ValueError, match="qkv_bias"):
        arch_to_hf_config(ModelArchConfig(family="llama", qkv_bias=True), 10)


@pytest.mark.parametrize("shard", [None, "30KB"])
def test_load_hf_checkpoint(tmp_path, shard):
    model = hf_model("qwen2_untied")
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    config, state = load_hf_checkpoint(tmp_path)
    assert hf_config_to_arch(config) == hf_config_to_arch(model.config)
    expected = model.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_load_hf_checkpoint_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)
    arch_to_hf_config(ModelArchConfig(), 10).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_padded_vocab_size_and_inputs():
    assert [padded_vocab_size(v, 2) for v in (100, 101)] == [100, 102]
    assert padded_vocab_size(101, 1) == 101
    mask = causal_attention_mask(2, 5, "cpu")
    reference = ~torch.ones(5, 5, dtype=torch.bool).tril()
    assert mask.shape == (2, 1, 5, 5) and torch.equal(mask[1, 0], reference)
    assert torch.equal(position_ids(2, 3), torch.tensor([[0, 1, 2], [0, 1, 2]]))
