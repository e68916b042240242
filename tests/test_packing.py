"""Sequence packing (THD) against the padded layout.

Pure helpers: first-fit-decreasing micro-batches under a token budget (every row once, within
the budget, a minimum count honoured), pack / unpack round trips, per-sequence next-token
targets, the padding fraction. Attention: ``varlen_causal_attention`` (CPU path) against SDPA
run on each sequence alone, with GQA. Model level (fp32, CPU, gloo): a tiny Llama on the
``torch`` spec, packed (Megatron ``PackedSeqParams``, its THD RoPE) vs padded logits of
sequences of different lengths in one micro-batch, and their gradients, at TP=1 and TP=2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed, use_layout

from mcore_rl.data.packing import pack, packed_groups, packed_targets, padding_fraction, unpack

LENGTHS = [10, 7, 4, 9, 1]


def _batch(lengths, width=12, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=g)
    lengths = torch.tensor(lengths)
    ids = ids * (torch.arange(width)[None] < lengths[:, None])
    return {"input_ids": ids, "input_lengths": lengths,
            "token_mask": (torch.arange(width)[None] < lengths[:, None]).float()}


def test_packed_groups_first_fit_decreasing():
    lengths = [5, 9, 3, 7, 2, 8]
    groups = packed_groups(lengths, 12)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 12 for g in groups)
    assert groups == [[1, 2], [5, 4], [3, 0]]  # 9+3, 8+2, 7+5 (FFD, longest first)
    many = packed_groups(lengths, 100, min_groups=4)
    assert len(many) == 4 and sorted(i for g in many for i in g) == list(range(6))
    assert len(packed_groups([3, 3], 100, min_groups=5)) == 2  # cannot split single rows
    with pytest.raises(ValueError, match="row 1 has 9 tokens.*max_tokens_per_microbatch"):
        packed_groups(lengths, 8)


def test_pack_unpack_roundtrip_and_targets():
    batch = _batch(LENGTHS)
    mb = pack(batch, [0, 2, 4], width_multiple=4)
    assert mb["input_ids"].shape == (1, 16)  # 15 tokens -> multiple of 4
    assert mb["cu_seqlens"].tolist() == [0, 10, 14, 15, 16]  # the padding tail: a sequence
    assert mb["position_ids"][0, :15].tolist() == list(range(10)) + list(range(4)) + [0]
    back = unpack(mb["input_ids"], mb["cu_seqlens"], 12, num_rows=3)
    assert torch.equal(back, batch["input_ids"][[0, 2, 4]])
    t = packed_targets(mb["input_ids"], mb["cu_seqlens"])
    ids = mb["input_ids"][0]
    assert t[0, 3] == ids[4] and t[0, 9] == 0 and t[0, 10] == ids[11] and t[0, 13] == 0
    shifted = unpack(torch.arange(16.0)[None], mb["cu_seqlens"], 12, shift=1)
    assert shifted[1, :5].tolist() == [0.0, 10.0, 11.0, 12.0, 0.0]
    assert padding_fraction(16, 15) == pytest.approx(1 / 16) and padding_fraction(0, 0) == 0.0


def test_varlen_attention_matches_per_sequence_sdpa():
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_rl.megatron.attention import varlen_causal_attention

    g = torch.Generator().manual_seed(0)
    lens = [6, 3, 5]
    t = sum(lens) + 2  # a padding tail
    q, k, v = torch.randn(t, 8, 16, generator=g), torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, 16, generator=g)
    cu = torch.tensor([0, 6, 9, 14], dtype=torch.int32)
    p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    out = varlen_causal_attention(q, k, v, p, 0.25)
    assert out.shape == (t, 128) and torch.isfinite(out).all()
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qs, ks.repeat_interleave(4, 0), vs.repeat_interleave(4, 0),
                                             is_causal=True, scale=0.25)
        assert (out[s:e] - ref.transpose(0, 1).reshape(e - s, 128)).abs().max() < 1e-5


def _model_checks(tp: int) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from test_attention import VOCAB, _hf_llama

    from mcore_rl.config.schema import MegatronConfig
    from mcore_rl.megatron.conversion import hf_config_to_arch, load_hf_weights
    from mcore_rl.megatron.model import build_model, position_ids

    hf = _hf_llama()
    arch = hf_config_to_arch(hf.config)
    torch.manual_seed(0)
    (chunk,) = build_model(arch, MegatronConfig(tensor_model_parallel_size=tp, layer_spec="torch"),
                           VOCAB, "cpu")
    load_hf_weights([chunk], hf.state_dict(), arch)
    lengths = [10, 7, 4]
    batch = _batch(lengths, width=10, vocab=VOCAB)
    ids = batch["input_ids"]
    weights = torch.linspace(0.5, 1.5, VOCAB)  # a loss that reads every valid logit

    def loss_of(logits, mask):
        full = gather_from_tensor_model_parallel_region(logits)[..., :VOCAB]
        return ((full.float() * weights).sum(-1) * mask).sum(), full

    chunk.zero_grad()
    out = chunk(ids, position_ids(3, 10), None)
    loss, padded = loss_of(out, batch["token_mask"])
    loss.backward()
    grads_padded = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    chunk.zero_grad()
    mb = pack(batch, [0, 1, 2], width_multiple=4)
    cu = mb["cu_seqlens"]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=10, max_seqlen_kv=10)
    out = chunk(mb["input_ids"], mb["position_ids"], None, packed_seq_params=params)
    loss_p, packed = loss_of(out, mb["token_mask"])
    loss_p.backward()
    unpacked = unpack(packed, cu, 10, num_rows=3)
    valid = batch["token_mask"].bool()
    return {
        "logit_diff": (unpacked - padded).abs().amax(-1)[valid].max().item(),
        "loss_diff": abs(loss_p.item() - loss.item()) / abs(loss.item()),
        "grad_diff": max((p.grad - grads_padded[n]).abs().max().item()
                         for n, p in chunk.named_parameters()),
        "grad_scale": max(g.abs().max().item() for g in grads_padded.values()),
    }


def _all_checks() -> dict:
    out = {"tp1": _model_checks(1)}
    use_layout(tensor_model_parallel_size=2)
    out["tp2"] = _model_checks(2)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_checks, 2)


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_model_matches_padded(results, tp):
    for rank_out in results:
        m = rank_out[f"tp{tp}"]
        assert m["logit_diff"] < 1e-4, m
        assert m["loss_diff"] < 1e-5, m
        assert m["grad_scale"] > 1e-3 and m["grad_diff"] < 1e-4 * m["grad_scale"], m
