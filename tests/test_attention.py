"""The ``torch`` layer spec (``TorchSDPAttention``) against Megatron's own ``DotProductAttention``.

Module level: the two core attentions on the same random q/k/v (fp32), for causal prefill
(``is_causal`` path vs Megatron's explicit mask), GQA, a left-padded batch (explicit mask;
rows that are all padding must stay finite), single-token decode and a 3-token chunk against a
longer KV cache (reference: Megatron's module with the bottom-right causal mask written out), and
the rollout decoder's ``decode_attention`` (each row at its own position in a KV cache).
Model level: a tiny Llama with GQA loaded from Hugging Face weights into the ``local`` and the
``torch`` spec gives the same logits (TP=1 and TP=2 over 2 gloo processes, spawned once), the
parameter names are identical, and the HF export of the torch spec returns the loaded weights.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed, use_layout
from transformers import AutoModelForCausalLM, LlamaConfig

from mcore_rl.config.schema import MegatronConfig, ModelArchConfig
from mcore_rl.megatron.model import attention_mask, layer_spec, position_ids

BATCH, SEQ, VOCAB = 3, 10, 96


def _config(heads: int, groups: int, tp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=16 * heads, num_attention_heads=heads,
                             num_query_groups=groups, tensor_model_parallel_size=tp,
                             use_cpu_initialization=True, attention_dropout=0.0,
                             masked_softmax_fusion=False)


def _modules(heads: int, groups: int, tp: int):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_rl.megatron.attention import TorchSDPAttention

    cfg = _config(heads, groups, tp)
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(**kw), TorchSDPAttention(**kw)


def _qkv(sq: int, sk: int, b: int, np_: int, ng: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(sq, b, np_, 16, generator=g), torch.randn(sk, b, ng, 16, generator=g),
            torch.randn(sk, b, ng, 16, generator=g))


def _core_attention_checks(tp: int) -> dict:
    """Max abs differences between the torch and Megatron core attentions, by case."""
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_rl.megatron.attention import decode_attention

    out = {}
    for heads, groups in ((4, 4), (8, 2)):
        local, sdpa = _modules(heads, groups, tp)
        np_, ng = heads // tp, groups // tp
        q, k, v = _qkv(SEQ, SEQ, BATCH, np_, ng, seed=heads)
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
        ref = local(q, k, v, causal)
        name = f"h{heads}g{groups}"
        out[f"{name}/causal_no_mask"] = (sdpa(q, k, v, None) - ref).abs().max().item()
        out[f"{name}/causal_explicit"] = (sdpa(q, k, v, causal) - ref).abs().max().item()
        # left padding: row r starts at position pad[r]; keys before it are masked
        pad = torch.tensor([0, 3, 6])
        keys_pad = torch.arange(SEQ)[None, :] < pad[:, None]  # [b, sk]
        mask = causal | keys_pad[:, None, None, :]
        got, want = sdpa(q, k, v, mask), local(q, k, v, mask)
        valid = (torch.arange(SEQ)[:, None] >= pad[None, :])  # [sq, b] query rows that are real
        diff = (got - want).abs().amax(dim=-1)  # [sq, b]
        out[f"{name}/padded_valid_rows"] = diff[valid].max().item()
        out[f"{name}/padded_finite"] = bool(torch.isfinite(got).all())
        # one new token / a 3-token chunk against a KV cache of 8: bottom-right causal
        for sq in (1, 3):
            sk = 8
            q, k, v = _qkv(sq, sk, BATCH, np_, ng, seed=sq)
            bottom_right = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).logical_not()[None, None]
            want = local(q, k, v, bottom_right)
            out[f"{name}/decode{sq}_causal"] = (sdpa(q, k, v, None) - want).abs().max().item()
            if sq == 1:
                got = sdpa(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
                out[f"{name}/decode1_no_mask"] = (got - want).abs().max().item()
        out[f"{name}/shape"] = tuple(sdpa(q, k, v, None).shape) == (3, BATCH, np_ * 16)
        # rollout decoding: one query per row at its own position over a KV cache whose later
        # positions hold other data, against Megatron's module on each row's keys 0..position
        q, k, v = _qkv(1, 8, BATCH, np_, ng, seed=5)
        positions = torch.tensor([7, 2, 0])
        got = decode_attention(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                               torch.arange(8)[None, :] > positions[:, None], local.softmax_scale)
        want = torch.cat([local(q[:, r:r + 1], k[:p + 1, r:r + 1], v[:p + 1, r:r + 1],
                                torch.zeros(1, 1, 1, p + 1, dtype=torch.bool))
                          for r, p in enumerate(positions.tolist())], dim=1)
        out[f"{name}/decode_per_row_positions"] = (got - want).abs().max().item()
    return out


def _hf_llama():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         attn_implementation="eager")
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def _logits(chunk, ids, mask) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = ids.shape
    with torch.no_grad():
        out = chunk(ids, position_ids(b, s), mask)
    return gather_from_tensor_model_parallel_region(out)[..., :VOCAB]


def _model_checks(tp: int) -> dict:
    from mcore_rl.megatron.conversion import export_hf_weights, hf_config_to_arch, load_hf_weights
    from mcore_rl.megatron.model import build_model, causal_attention_mask

    hf = _hf_llama()
    arch: ModelArchConfig = hf_config_to_arch(hf.config)
    chunks = {}
    for spec in ("local", "torch"):
        torch.manual_seed(0)
        (chunk,) = build_model(arch, MegatronConfig(tensor_model_parallel_size=tp, layer_spec=spec),
                               VOCAB, "cpu")
        load_hf_weights([chunk], hf.state_dict(), arch)
        chunks[spec] = chunk
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    local = _logits(chunks["local"], ids, attention_mask("local", BATCH, SEQ, "cpu"))
    torch_spec = _logits(chunks["torch"], ids, attention_mask("torch", BATCH, SEQ, "cpu"))
    # right-padded rows with an explicit padding mask (keys past each row's length masked)
    lengths = torch.tensor([SEQ, 7, 4])
    key_pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
    padded_mask = causal_attention_mask(BATCH, SEQ, "cpu") | key_pad[:, None, None, :]
    padded = _logits(chunks["torch"], ids, padded_mask)
    valid = torch.arange(SEQ)[None, :] < lengths[:, None]
    with torch.no_grad():
        hf_logits = hf(ids).logits
    exported = dict(export_hf_weights([chunks["torch"]], arch, VOCAB))
    return {
        "max_diff": (torch_spec - local).abs().max().item(),
        "hf_diff": (torch_spec - hf_logits).abs().max().item(),
        "logit_std": local.std().item(),
        "padded_diff": (padded - local).abs().amax(-1)[valid].max().item(),
        "names_local": sorted(n for n, _ in chunks["local"].named_parameters()),
        "names_torch": sorted(n for n, _ in chunks["torch"].named_parameters()),
        "export_mismatch": [n for n, t in hf.state_dict().items() if not torch.equal(exported[n], t)],
        "export_names": sorted(exported) == sorted(hf.state_dict()),
    }


def _all_checks() -> dict:
    out = {"tp1_core": _core_attention_checks(1), "tp1_model": _model_checks(1)}
    use_layout(tensor_model_parallel_size=2)
    out["tp2_core"] = _core_attention_checks(2)
    out["tp2_model"] = _model_checks(2)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_checks, 2)


@pytest.mark.parametrize("tp", [1, 2])
def test_core_attention_matches_megatron(results, tp):
    for rank_out in results:
        checks = rank_out[f"tp{tp}_core"]
        for case, value in checks.items():
            if case.endswith("finite") or case.endswith("shape"):
                assert value is True, case
            else:
                assert value < 1e-5, (case, value)


@pytest.mark.parametrize("tp", [1, 2])
def test_torch_spec_logits_match_local(results, tp):
    for rank_out in results:
        m = rank_out[f"tp{tp}_model"]
        assert m["logit_std"] > 0.5  # the weights are far from trivial
        assert m["max_diff"] < 1e-4, m["max_diff"]  # fp32, same maths in another order
        assert m["hf_diff"] < 1e-3, m["hf_diff"]
        assert m["padded_diff"] < 1e-4, m["padded_diff"]


@pytest.mark.parametrize("tp", [1, 2])
def test_torch_spec_keeps_parameter_names_and_conversion(results, tp):
    for rank_out in results:
        m = rank_out[f"tp{tp}_model"]
        assert m["names_torch"] == m["names_local"]
        assert m["export_names"] and m["export_mismatch"] == []


def test_layer_spec_choices():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mcore_rl.megatron.attention import TorchSDPAttention

    def core(name):
        return layer_spec(name).submodules.self_attention.submodules.core_attention

    assert core("local") is DotProductAttention
    assert core("torch") is TorchSDPAttention
    with pytest.raises(ValueError, match="megatron.layer_spec must be one of"):
        layer_spec("flash")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs Transformer Engine.*layer_spec=torch"):
            layer_spec("transformer_engine")
    assert attention_mask("torch", 2, 4, "cpu") is None
    assert attention_mask("local", 2, 4, "cpu").shape == (2, 1, 4, 4)


def test_config_validation_of_layer_spec_and_compile():
    from mcore_rl.config.loader import ConfigError, validate
    from mcore_rl.config.schema import TrainConfig

    cfg = TrainConfig()
    cfg.cluster.device = "cpu"
    cfg.policy.megatron.layer_spec = "torch"
    validate(cfg)  # torch spec on CPU is fine
    cfg.policy.megatron.layer_spec = "flash"
    cfg.policy.megatron.compile_layers = True
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "policy.megatron.layer_spec must be one of local, torch, transformer_engine" in str(err.value)
    assert "policy.megatron.compile_layers needs a GPU" in str(err.value)


def test_decode_attention_equals_megatron_order_of_operations_in_bf16():
    """``decode_attention`` (scale in the product's accumulator, softmax written in bf16 by one
    kernel) against Megatron's order (query scaled in bf16, fp32 softmax, then cast): equal bit
    for bit at a power-of-two scale (head dim 64), within bf16 rounding at another."""
    from mcore_rl.megatron.attention import decode_attention

    def megatron_order(query, keys, values, mask, scale):
        b, ng, s, hn = keys.shape
        q = query[0].reshape(b, ng, -1, hn) * scale
        scores = torch.matmul(q, keys.transpose(2, 3)).masked_fill(mask[:, None, None, :],
                                                                   float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.matmul(probs, values).reshape(1, b, -1)

    g = torch.Generator().manual_seed(0)
    rows, ng, np_, span = 16, 3, 9, 128
    for hn, exact in ((64, True), (48, False)):
        cache = [torch.randn(32, ng, 256, hn, generator=g).bfloat16() for _ in range(2)]
        keys, values = (c[:rows][:, :, :span] for c in cache)  # strided views, as the decoder's
        query = torch.randn(1, rows, np_, hn, generator=g).bfloat16()
        mask = torch.arange(span)[None] > torch.randint(0, span, (rows,), generator=g)[:, None]
        got = decode_attention(query, keys, values, mask, hn ** -0.5)
        want = megatron_order(query, keys, values, mask, hn ** -0.5)
        assert got.shape == (1, rows, np_ * hn) and got.dtype == torch.bfloat16
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_shared_prompt_decode_attention_equals_rows_decoded_alone():
    """``shared_decode_attention`` (one copy of each group's prompt keys, each row's response
    keys apart) against ``decode_attention`` over the same keys laid out per row (prompt, then
    response, then padding), in fp32 and bf16: the bound of its docstring, each output element
    within ``4 * eps(dtype)`` of the probability-weighted mean of ``|v|`` (bf16: the
    probabilities and the two partial outputs each rounded once more; fp32: the softmax's and
    the products' sums in another order); groups of 4 rows with prompts of different lengths,
    rows at different response positions, GQA (9 query heads, 3 KV heads)."""
    from mcore_rl.megatron.attention import decode_attention, shared_decode_attention

    g = torch.Generator().manual_seed(1)
    groups, size, ng, np_, hn, sp, sr = 3, 4, 3, 9, 64, 128, 64
    b, span = groups * size, sp + sr
    for dtype in (torch.float32, torch.bfloat16):
        prompt_len = torch.tensor([7, 128, 40]).repeat_interleave(size)  # per row
        response_pos = torch.randint(0, sr, (b,), generator=g)  # the row's current token
        pk, pv = (torch.randn(groups, ng, sp, hn, generator=g).to(dtype) for _ in range(2))
        rk, rv = (torch.randn(b, ng, sr, hn, generator=g).to(dtype) for _ in range(2))
        query = torch.randn(1, b, np_, hn, generator=g).to(dtype)
        mask = torch.cat((torch.arange(sp)[None] >= prompt_len[:, None],
                          torch.arange(sr)[None] > response_pos[:, None]), dim=1)
        got = shared_decode_attention(query, pk, pv, rk, rv, mask, hn ** -0.5)
        # the same keys per row: prompt at 0 .. L-1, response at L .. L + j, then zeros
        keys, values = (torch.zeros(b, ng, span, hn, dtype=dtype) for _ in range(2))
        for r in range(b):
            n, j = int(prompt_len[r]), int(response_pos[r])
            for full, prompt, own in ((keys, pk, rk), (values, pv, rv)):
                full[r, :, :n] = prompt[r // size, :, :n]
                full[r, :, n:n + j + 1] = own[r, :, :j + 1]
        alone_mask = torch.arange(span)[None] > (prompt_len + response_pos)[:, None]
        want = decode_attention(query, keys, values, alone_mask, hn ** -0.5)
        assert got.shape == want.shape and got.dtype == dtype
        q = query.float()[0].reshape(b, ng, -1, hn)
        scores = (q @ keys.float().transpose(2, 3) * hn ** -0.5).masked_fill(
            alone_mask[:, None, None, :], float("-inf"))
        magnitude = (torch.softmax(scores, -1) @ values.float().abs()).reshape(got.shape)
        diff = (got.float() - want.float()).abs()
        assert (diff <= 4 * torch.finfo(dtype).eps * magnitude).all(), dtype
        assert diff.max() > 0  # not the same order of operations: not bit for bit


def test_context_parallel_chunks_are_megatrons_load_balanced_layout():
    """CP rank r holds chunks r and 2 CP - 1 - r of 2 CP (Megatron-Core's RoPE slicing,
    ``get_pos_emb_on_this_cp_rank``); the ranks' slices put back in global order give the
    tensor again."""
    from mcore_rl.megatron import context_parallel as cpar

    assert cpar.local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpar.local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cpar.local_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    x = torch.arange(2 * 12 * 3).view(2, 12, 3)
    parts = [cpar.split(x, 1, 3, r) for r in range(3)]
    assert torch.equal(cpar._unshuffle(torch.cat(parts, dim=1), 1, 3), x)
    assert cpar.split(x, 1, 1, 0) is x
    with pytest.raises(ValueError, match="not a multiple of 2 x context_parallel_size"):
        cpar.local_positions(10, 3, 0)
    with pytest.raises(ValueError, match="outside"):
        cpar.local_positions(8, 2, 2)


def test_context_parallel_packed_layout_is_per_sequence():
    """A packed row (sequences of multiples of 2 CP): rank r holds chunks r and 2 CP - 1 - r of
    every sequence, sequences in order (Transformer Engine's THD layout,
    ``thd_get_partitioned_indices``); one sequence of the whole width is the padded layout; the
    ranks' slices put back in packed order give the row again."""
    from mcore_rl.megatron import context_parallel as cpar

    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    assert cpar.local_positions(24, 2, 0, cu_seqlens=cu).tolist() == \
        [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]
    assert cpar.local_positions(24, 2, 1, cu_seqlens=cu).tolist() == \
        [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]
    for cp, width in ((2, 8), (3, 12), (4, 24)):
        whole = torch.tensor([0, width], dtype=torch.int32)
        assert all(torch.equal(cpar.local_positions(width, cp, r, cu_seqlens=whole),
                               cpar.local_positions(width, cp, r)) for r in range(cp))
    cu3 = torch.tensor([0, 6, 12, 30, 36], dtype=torch.int32)
    x = torch.arange(2 * 36 * 2).view(2, 36, 2)
    parts = [cpar.split(x, 1, 3, r, cu3) for r in range(3)]
    assert all(p.shape == (2, 12, 2) for p in parts)
    assert torch.equal(cpar._unshuffle(torch.cat(parts, dim=1), 1, 3, cu3), x)
    with pytest.raises(ValueError, match=r"packed sequences \[6, 6\] .* not each a multiple"):
        cpar.local_positions(12, 2, 0, cu_seqlens=torch.tensor([0, 6, 12], dtype=torch.int32))


def _te_partitioned_indices(cu_seqlens: list, total: int, world: int, rank: int) -> list:
    """Transformer Engine's ``thd_get_partitioned_indices`` (the indices Megatron-Core's
    ``get_thd_batch_on_this_cp_rank`` selects a rank's tokens with), transcribed token by token
    from its CUDA kernel (``thd_partition_indices_kernel`` / ``thd_partition_src_index``,
    transformer_engine/common/fused_attn/context_parallel.cu, TE 2.19-2.20): the padded
    ``cu_seqlens`` divided by the world size, a binary search for the local token's sequence,
    the first half of its local slice from chunk ``rank`` and the second from chunk ``2 world -
    2 - rank`` counted from the end of the first (``index + cu / world * world + seq_len / 2 *
    offset``)."""
    assert total % (2 * world) == 0 and all(c % (2 * world) == 0 for c in cu_seqlens)
    cu_s = [c // world for c in cu_seqlens]
    out = []
    for token in range(total // world):
        seq = max(j for j in range(len(cu_s) - 1) if cu_s[j] <= token)  # binary_search
        seq_len = cu_s[seq + 1] - cu_s[seq]
        index = token - cu_s[seq]
        offset = rank if index < seq_len // 2 else (world - 1) * 2 - rank
        out.append(index + cu_s[seq] * world + seq_len // 2 * offset)
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_context_parallel_packed_split_is_transformer_engines(cp):
    """The packed split that the worker applies to ids and positions (and that our THD RoPE and
    gathers assume) selects, on every CP rank, exactly the tokens Transformer Engine's
    ``thd_get_partitioned_indices`` selects, in its order: TE's CP attention on THD batches
    expects each rank to hold chunks ``r`` and ``2 CP - 1 - r`` of every sequence (padded to
    ``2 CP``), sequences in order. The rows come from :func:`mcore_rl.data.packing.
    make_packed_microbatches` (lengths 1 .. 17, a padding tail, a token budget), so this is the
    layout the worker feeds TE; checked both with a host and (the TE spec's) a second,
    equal ``cu_seqlens`` object, which goes through the second cache entry."""
    from mcore_rl.data.packing import CU_SEQLENS, PACKED_IDS, make_packed_microbatches
    from mcore_rl.megatron import context_parallel as cpar

    g = torch.Generator().manual_seed(cp)
    lengths = torch.tensor([1, 17, 5, 2 * cp, 9, 3, 12, 2 * cp + 1])
    ids = torch.randint(1, 50, (len(lengths), int(lengths.max())), generator=g)
    batch = {"input_ids": ids * (torch.arange(ids.shape[1]) < lengths[:, None]),
             "input_lengths": lengths}
    mbs = make_packed_microbatches(batch, max_tokens=40, width_multiple=3,
                                   sequence_multiple=2 * cp)
    assert len(mbs) > 1 and any(int(mb[CU_SEQLENS].numel()) > 3 for mb in mbs)
    for mb in mbs:
        cu, width = mb[CU_SEQLENS], mb[PACKED_IDS].shape[1]
        twin = cu.clone()  # the device copy's stand-in: another object, same lengths
        for r in range(cp):
            expected = _te_partitioned_indices(cu.tolist(), width, cp, r)
            assert cpar.local_positions(width, cp, r, cu_seqlens=cu).tolist() == expected
            assert cpar.local_positions(width, cp, r, cu_seqlens=twin).tolist() == expected
            assert cpar.split(mb[PACKED_IDS], 1, cp, r, cu)[0].tolist() == \
                mb[PACKED_IDS][0, expected].tolist()
