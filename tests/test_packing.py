"""Sequence packing (THD) against the padded layout.

Pure helpers: first-fit-decreasing micro-batches under a token budget (every row once, within
the budget, a minimum count honoured), pack / unpack round trips, per-sequence next-token
targets, the padding fraction. Attention: ``varlen_causal_attention`` (CPU path) against SDPA
run on each sequence alone, with GQA. Model level (fp32, CPU, gloo): a tiny Llama on the
``torch`` spec, packed (Megatron ``PackedSeqParams``, its THD RoPE) vs padded logits of
sequences of different lengths in one micro-batch, and their gradients, at TP=1 and TP=2.
Workers: packed against padded policy and critic steps at DP=2 and TP=2. Context parallelism:
each sequence padded to 2 CP (pack / unpack), RoPE on each CP rank against Megatron-Core's, and
packed policy and critic steps at CP=2 against CP=1, padded and packed.
"""

from __future__ import annotations

from types import SimpleNamespace

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


@pytest.mark.parametrize("overrides, needle", [
    (["policy.megatron.layer_spec=local"], "policy.sequence_packing needs policy.megatron.layer_spec"),
    (["cluster.num_workers=2", "policy.megatron.pipeline_model_parallel_size=2"],
     "policy.sequence_packing needs policy.megatron.pipeline_model_parallel_size=1"),
])
def test_config_refuses_packing_where_it_cannot_run(overrides, needle):
    from mcore_rl.config.checks import ConfigError
    from mcore_rl.config.loader import load_config

    with pytest.raises(ConfigError) as e:
        load_config("grpo_synthetic", ["policy.sequence_packing=true", *overrides])
    assert needle in str(e.value)
    cfg = load_config("grpo_synthetic", ["policy.sequence_packing=true",
                                         "policy.megatron.layer_spec=torch"])
    assert cfg.policy.sequence_packing
    cfg = load_config("grpo_synthetic", ["policy.sequence_packing=true", "cluster.num_workers=2",
                                         "policy.megatron.layer_spec=torch",
                                         "policy.megatron.context_parallel_size=2",
                                         "policy.megatron.cp_comm_type=all_gather"])
    assert cfg.policy.sequence_packing and cfg.policy.megatron.context_parallel_size == 2


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


def test_pack_pads_each_sequence_for_context_parallelism():
    """``sequence_multiple`` (2 CP): each sequence padded right after its tokens, the padding
    part of its span in ``cu_seqlens`` and its positions; the packed length a multiple of
    both multiples; unpack with the rows' lengths gives the rows back; the token budget counts
    each row with its padding."""
    from mcore_rl.data.packing import make_packed_microbatches

    batch = _batch(LENGTHS)  # 10, 7, 4, 9, 1
    mb = pack(batch, [0, 1, 4], width_multiple=8, sequence_multiple=4)
    assert mb["cu_seqlens"].tolist() == [0, 12, 20, 24]  # 10 -> 12, 7 -> 8, 1 -> 4
    ids = mb["input_ids"][0]
    assert torch.equal(ids[:10], batch["input_ids"][0, :10]) and (ids[10:12] == 0).all()
    assert torch.equal(ids[12:19], batch["input_ids"][1, :7]) and ids[19] == 0
    assert ids[20] == batch["input_ids"][4, 0] and (ids[21:] == 0).all()
    assert mb["position_ids"][0].tolist() == list(range(12)) + list(range(8)) + list(range(4))
    lengths = batch["input_lengths"][[0, 1, 4]]
    back = unpack(mb["input_ids"], mb["cu_seqlens"], 12, num_rows=3, lengths=lengths)
    assert torch.equal(back, batch["input_ids"][[0, 1, 4]])
    shifted = unpack(torch.arange(24.0)[None], mb["cu_seqlens"], 12, shift=1, lengths=lengths)
    assert shifted[1].tolist() == [0.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0] + [0.0] * 5
    assert pack(batch, [3], width_multiple=8, sequence_multiple=4)["cu_seqlens"].tolist() == \
        [0, 12, 16]  # 9 -> 12, then a tail of 4 to the multiple of 8
    mbs = make_packed_microbatches(batch, 16, width_multiple=4, sequence_multiple=4)
    assert sorted(int(i) for m in mbs for i in m["row_index"]) == list(range(5))
    for m in mbs:  # the budget holds the padded spans: 12 + 4, 8 + 4 + ...
        spans = (m["cu_seqlens"][1:] - m["cu_seqlens"][:-1]).tolist()
        assert all(s % 4 == 0 for s in spans) and sum(spans) <= 16
        assert int(m["max_seqlen"]) == max(spans)
        assert torch.equal(unpack(m["packed_input_ids"], m["cu_seqlens"], m["input_ids"].shape[1],
                                  num_rows=len(m["row_index"]), lengths=m["input_lengths"]),
                           m["input_ids"])


def test_unpack_equals_a_per_sequence_copy():
    """unpack's one scatter against copying each sequence on its own (the former loop), on
    random layouts: a padding tail, spare columns, shift 0 and 1, fewer rows than sequences."""
    def per_sequence(values, cu, width, shift, num_rows):
        cu = cu.tolist()
        n = len(cu) - 1 if num_rows is None else num_rows
        out = values.new_zeros((n, width, *values.shape[1:]))
        for i in range(n):
            s, e = cu[i], cu[i + 1]
            out[i, shift:e - s] = values[s:e - shift]
        return out

    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        n = int(torch.randint(1, 6, (), generator=g))
        lengths = torch.randint(1, 7, (n,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
        values = torch.randn(int(cu[-1]) + int(torch.randint(0, 3, (), generator=g)), 3, generator=g)
        width = int(lengths.max()) + int(torch.randint(0, 3, (), generator=g))
        for shift in (0, 1):
            for rows in (None, max(1, n - 1)):
                assert torch.equal(unpack(values[None], cu, width, shift, rows),
                                   per_sequence(values, cu, width, shift, rows))


class _OneRankGroup:
    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_rope_matches_megatron_per_sequence_rope(interleaved):
    """mcore_rl.megatron.rope.packed_rope (one gather, no host sync) equals Megatron-Core's THD
    RoPE, which rotates each sequence from position 0 on its own; a padding tail counts as a
    sequence, and a second micro-batch with other lengths does not reuse the first one's
    cached frequencies."""
    from mcore_rl.megatron.rope import megatron_function, packed_rope

    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)  # Megatron's RotaryEmbedding layout
    angles = torch.outer(torch.arange(16).float(), inv)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [16, 1, 1, 8]
    original = megatron_function("_apply_rotary_pos_emb_thd")
    torch.manual_seed(0)
    for lengths in ([10, 4, 1, 1], [3, 7, 6]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        t = torch.randn(int(cu[-1]), 3, 8, requires_grad=True)
        kw = dict(rotary_interleaved=interleaved, cp_group=_OneRankGroup())
        ref = original(t, cu, freqs, **kw)
        got = packed_rope(original, t, cu, freqs, **kw)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
        g = torch.randn_like(ref)
        (ga,) = torch.autograd.grad(ref, t, g)
        (gb,) = torch.autograd.grad(got, t, g)
        torch.testing.assert_close(gb, ga, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_packed_positions_count_from_each_sequence_start(dtype):
    """packed_positions gives each token its index within its sequence (a per-sequence arange,
    computed another way), with empty sequences and a padding tail past ``cu_seqlens[-1]``;
    traced for Inductor, ``searchsorted`` gets ``cu_seqlens`` itself as its boundaries, not a
    slice of it (torch 2.11's lowering fails on a sliced view: NotImplementedError SliceView,
    seen on the GPU with policy.megatron.compile_layers)."""
    from mcore_rl.megatron.rope import packed_positions

    for lengths, tail in (([10, 4, 1, 1], 0), ([3, 0, 7, 0, 6], 0), ([5], 0), ([2, 3], 4)):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)
        ref = torch.cat([torch.arange(n) for n in lengths]
                        + [torch.arange(lengths[-1], lengths[-1] + tail)])
        got = packed_positions(cu, sum(lengths) + tail)
        assert got.dtype == torch.int64 and torch.equal(got, ref), (lengths, got, ref)

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    cu = torch.tensor([0, 3, 10, 16], dtype=dtype)
    compiled = torch.compile(packed_positions, backend=keep, fullgraph=True)
    assert torch.equal(compiled(cu, 16), packed_positions(cu, 16))
    (search,) = [n for n in graphs[0].graph.nodes if n.target is torch.searchsorted]
    assert search.args[0].op == "placeholder"  # the input itself, no slice in between


class _Rank:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp", [2, 3])
def test_packed_rope_matches_megatron_on_each_context_parallel_rank(cp):
    """With context parallelism, packed_rope (this rank's positions in one gather) equals
    Megatron-Core's THD RoPE on each CP rank (which slices chunks r and 2 CP - 1 - r of the
    frequencies sequence by sequence, ``_get_thd_freqs_on_this_cp_rank``): it pins the layout
    of :mod:`mcore_rl.megatron.context_parallel` to Megatron's; the rank's tokens rotated by the
    positions they hold in the whole packed row."""
    from mcore_rl.megatron import context_parallel as cpar
    from mcore_rl.megatron.rope import megatron_function, packed_rope

    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    angles = torch.outer(torch.arange(32).float(), inv)  # per-sequence frequencies (no packed
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # row is 32 tokens long)
    original = megatron_function("_apply_rotary_pos_emb_thd")
    torch.manual_seed(0)
    m = 2 * cp
    for spans in ([2 * m, m, 4 * m], [m, 3 * m]):
        cu = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32)
        whole = torch.randn(int(cu[-1]), 3, 8)
        full = original(whole, cu, freqs, cp_group=_OneRankGroup())
        for rank in range(cp):
            t = cpar.split(whole, 0, cp, rank, cu).requires_grad_(True)
            kw = dict(cp_group=_Rank(cp, rank))
            ref = original(t, cu, freqs, **kw)
            got = packed_rope(original, t, cu, freqs, **kw)
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
            torch.testing.assert_close(got, cpar.split(full, 0, cp, rank, cu), rtol=0, atol=1e-6)
            g = torch.randn_like(ref)
            (ga,) = torch.autograd.grad(ref, t, g)
            (gb,) = torch.autograd.grad(got, t, g)
            torch.testing.assert_close(gb, ga, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim,mscale", [(8, 1.0), (4, 0.7)])
def test_rotate_equals_megatron_bshd_rope_bit_for_bit(dtype, rot_dim, mscale):
    """mcore_rl.megatron.rope.rotate (cos/sin once per frequency tensor, 4 kernels) gives
    Megatron-Core's _apply_rotary_pos_emb_bshd bit for bit, values and gradients: training
    frequencies [s, 1, 1, d], decode frequencies one position per row [1, b, 1, d], a
    non-contiguous query (a view of a fused QKV output), partial rotary dims, mscale; the
    cached cos/sin are not reused for another frequency tensor or dtype; interleaved rotations
    go to Megatron's function."""
    from mcore_rl.megatron import rope

    original = rope.megatron_function("_apply_rotary_pos_emb_bshd")
    inv = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    g = torch.Generator().manual_seed(0)
    for freqs_shape in ((5, 1, 1), (1, 3, 1)):
        positions = torch.randint(0, 50, (freqs_shape[0] * freqs_shape[1],), generator=g).float()
        angles = torch.outer(positions, inv)
        freqs = torch.cat([angles, angles], dim=-1).view(*freqs_shape, rot_dim)
        qkv = torch.randn(5 if freqs_shape[0] == 5 else 1, 3, 2, 3 * 8, generator=g).to(dtype)
        qkv.requires_grad_(True)
        t = qkv[..., 8:16]  # non-contiguous
        if freqs_shape[0] == 1:
            t = t[:1]
        ref = original(t, freqs, rotary_interleaved=False, mscale=mscale)
        got = rope.rotate(original, t, freqs, rotary_interleaved=False, mscale=mscale)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got, ref)
        again = rope.rotate(original, t, freqs, mscale=mscale)  # cached cos/sin
        assert torch.equal(again, ref)
        other = t.detach().double()  # the same frequencies, another dtype: no cached reuse
        assert torch.equal(rope.rotate(original, other, freqs, mscale=mscale),
                           original(other, freqs, mscale=mscale))
        w = torch.randn(ref.shape, generator=g).to(dtype)
        (ga,) = torch.autograd.grad(ref, qkv, w)
        (gb,) = torch.autograd.grad(got, qkv, w)
        assert torch.equal(gb, ga)
    inter = rope.rotate(original, t, freqs, rotary_interleaved=True, mscale=mscale)
    assert torch.equal(inter, original(t, freqs, rotary_interleaved=True, mscale=mscale))


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
def results(spawned):
    return [r["model"] for r in spawned]


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_model_matches_padded(results, tp):
    for rank_out in results:
        m = rank_out[f"tp{tp}"]
        assert m["logit_diff"] < 1e-4, m
        assert m["loss_diff"] < 1e-5, m
        assert m["grad_scale"] > 1e-3 and m["grad_diff"] < 1e-4 * m["grad_scale"], m


# ---------------------------------------------------------------- workers: packed vs padded
WORKER_VOCAB = 48


def _worker_pair(kind: str, tp: int) -> tuple:
    """(padded, packed) workers of the same seed: padded micro-batches of 2 rows, packed ones
    under a 24-token budget (several sequences each)."""
    from dist_utils import _WORLD

    from mcore_rl.config.schema import ModelArchConfig, OptimizerConfig
    from mcore_rl.config.schema import MegatronConfig
    from mcore_rl.megatron.conversion import arch_to_hf_config
    from mcore_rl.workers.policy import PolicyWorker
    from mcore_rl.workers.value import ValueWorker

    arch = ModelArchConfig(family="qwen2", num_layers=2, hidden_size=32, num_attention_heads=4,
                           num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=64,
                           qkv_bias=True, tie_word_embeddings=False, vocab_size=WORKER_VOCAB)
    common = dict(hf_path=None, hf_config=arch_to_hf_config(arch, WORKER_VOCAB).to_dict(),
                  vocab_size=WORKER_VOCAB, arch=arch,
                  megatron=MegatronConfig(tensor_model_parallel_size=tp, layer_spec="torch"),
                  optimizer=OptimizerConfig(name="sgd", lr=0.1, clip_grad=0.0),
                  rank=_WORLD["rank"], world_size=_WORLD["world_size"], master_addr="127.0.0.1",
                  master_port=_WORLD["port"], device="cpu", seed=7, total_optimizer_steps=10,
                  global_batch_size=8)
    cls, extra = (PolicyWorker, {"temperature": 0.8}) if kind == "policy" else (ValueWorker, {})
    padded = cls(**common, **extra)
    packed = cls(**common, **extra, sequence_packing=True, max_tokens_per_microbatch=24)
    return padded, packed


def _worker_checks(tp: int) -> dict:
    from rollouts import random_rows

    from mcore_rl.algorithms.losses import ClippedPGLoss, ClippedValueLoss
    from mcore_rl.config.schema import LossConfig, ValueLossConfig
    from mcore_rl.data import batch as B

    dp_rank = torch.distributed.get_rank() if tp == 1 else 0
    g = torch.Generator().manual_seed(0)
    batch = random_rows(8, WORKER_VOCAB, (2, 6), (1, 8), g)
    batch["advantages"] = torch.randn(8, generator=g)[:, None] * batch["token_mask"]
    batch["returns"] = torch.randn(batch["token_mask"].shape, generator=g) * batch["token_mask"]
    if tp == 1:  # DP=2: each rank its own shard (different lengths, counts balanced)
        batch = B.shard(batch, 2)[dp_rank]
    out = {}
    pol_pad, pol_pack = _worker_pair("policy", tp)
    lp = pol_pad.get_logprobs(batch, 2)
    out["logprobs_diff"] = (pol_pack.get_logprobs(batch, 2) - lp).abs().max().item()
    out["logprobs_nonzero"] = bool((lp != 0).any())
    batch["prev_logprobs"] = lp + 0.05 * batch["token_mask"]
    loss = ClippedPGLoss(LossConfig(kl_coef=0.0))
    m_pad, m_pack = pol_pad.train(batch, loss, 8, 2), pol_pack.train(batch, loss, 8, 2)
    out["policy_metrics"] = {k: (m_pad[k], m_pack[k]) for k in ("loss", "grad_norm", "num_valid_tokens")}
    out["padding_fraction"] = (m_pad["padding_fraction"], m_pack["padding_fraction"])
    w_pad, w_pack = dict(pol_pad.model[0].named_parameters()), dict(pol_pack.model[0].named_parameters())
    out["policy_weight_diff"] = max((w_pad[n] - w_pack[n]).abs().max().item() for n in w_pad)
    val_pad, val_pack = _worker_pair("value", tp)
    v = val_pad.get_values(batch, 2)
    out["values_diff"] = (val_pack.get_values(batch, 2) - v).abs().max().item()
    out["values_first_zero"] = bool((val_pack.get_values(batch, 2)[:, 0] == 0).all())
    batch["prev_values"] = v
    vloss = ClippedValueLoss(ValueLossConfig(cliprange=0.05, coef=1.0))
    m_pad, m_pack = val_pad.train(batch, vloss, 8, 2), val_pack.train(batch, vloss, 8, 2)
    out["value_metrics"] = {k: (m_pad[k], m_pack[k]) for k in ("loss", "grad_norm")}
    return out


def _all_worker_checks() -> dict:
    use_layout()
    out = {"dp2": _worker_checks(1)}
    use_layout(tensor_model_parallel_size=2)
    out["tp2"] = _worker_checks(2)
    return out


@pytest.fixture(scope="module")
def worker_results(spawned):
    return [r["workers"] for r in spawned]


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_packed_workers_match_padded(worker_results, layout):
    for rank_out in worker_results:
        m = rank_out[layout]
        assert m["logprobs_nonzero"] and m["logprobs_diff"] < 1e-5, m
        for k, (pad, packed) in {**m["policy_metrics"], **m["value_metrics"]}.items():
            assert packed == pytest.approx(pad, rel=1e-5, abs=1e-7), (k, m)
        assert m["policy_weight_diff"] < 1e-6, m
        assert m["values_diff"] < 1e-5 and m["values_first_zero"], m
        pad_frac, packed_frac = m["padding_fraction"]
        assert packed_frac == 0.0 and 0.1 < pad_frac < 0.9, m  # no TP rounding without SP


# ------------------------------------------------ context parallelism: packed CP=2 vs CP=1
# Uneven rows: 3, 1 and 2 tokens are shorter than 2 CP = 4; 13, 9, 6 and 11 are padded to a
# multiple of 4; 16 needs no padding.
CP_LENGTHS = [13, 3, 9, 1, 16, 6, 2, 11]
CP_BUDGET = 24  # tokens of a packed micro-batch: several sequences each, padding included
CP_TORCH = dict(context_parallel_size=2, cp_comm_type="all_gather")  # the torch spec: _cp_worker


def _cp_rows() -> dict:
    """Right-padded rows of :data:`CP_LENGTHS` with a loss's inputs: response tokens after a
    prompt of a third of the row (at least one token), advantages, old logprobs near
    log(1/V) (clipped and unclipped ratios both occur) and returns for the critic."""
    import math

    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor(CP_LENGTHS)
    width = int(lengths.max())
    cols = torch.arange(width)[None]
    prompt = (lengths // 3).clamp(min=1)
    valid = cols < lengths[:, None]
    mask = (valid & (cols >= prompt[:, None])).float()
    ids = torch.randint(1, WORKER_VOCAB, (len(CP_LENGTHS), width), generator=g) * valid
    return {"input_ids": ids, "input_lengths": lengths, "prompt_lengths": prompt,
            "token_mask": mask, "sample_mask": torch.ones(len(CP_LENGTHS)),
            "advantages": torch.randn(len(CP_LENGTHS), 1, generator=g) * mask,
            "prev_logprobs": (-math.log(WORKER_VOCAB) + 0.3 * torch.randn(mask.shape, generator=g))
            * mask,
            "returns": torch.randn(mask.shape, generator=g) * mask,
            "prev_values": 0.1 * torch.randn(mask.shape, generator=g) * mask}


def _cp_worker(kind: str, packed: bool, **megatron):
    from dist_utils import _WORLD

    from mcore_rl.config.schema import MegatronConfig, ModelArchConfig, OptimizerConfig
    from mcore_rl.megatron.conversion import arch_to_hf_config
    from mcore_rl.workers.policy import PolicyWorker
    from mcore_rl.workers.value import ValueWorker

    arch = ModelArchConfig(family="qwen2", num_layers=2, hidden_size=32, num_attention_heads=4,
                           num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=64,
                           qkv_bias=True, tie_word_embeddings=False, vocab_size=WORKER_VOCAB)
    cls, extra = (PolicyWorker, {"temperature": 0.8}) if kind == "policy" else (ValueWorker, {})
    return cls(hf_path=None, hf_config=arch_to_hf_config(arch, WORKER_VOCAB).to_dict(),
               vocab_size=WORKER_VOCAB, arch=arch,
               megatron=MegatronConfig(layer_spec="torch", **megatron),
               optimizer=OptimizerConfig(name="sgd", lr=0.1, clip_grad=0.0),
               rank=_WORLD["rank"], world_size=_WORLD["world_size"], master_addr="127.0.0.1",
               master_port=_WORLD["port"], device="cpu", seed=7, total_optimizer_steps=10,
               global_batch_size=len(CP_LENGTHS), sequence_packing=packed,
               max_tokens_per_microbatch=CP_BUDGET if packed else None, **extra)


def _cp_step(kind: str, packed: bool, batch: dict, **megatron) -> dict:
    """Per-token outputs of ``batch`` (this DP rank's rows), then one training step on them:
    the outputs, the step's loss and grad norm, and the weights after it."""
    from mcore_rl.algorithms.losses import ClippedPGLoss, ClippedValueLoss
    from mcore_rl.config.schema import LossConfig, ValueLossConfig

    w = _cp_worker(kind, packed, **megatron)
    if kind == "policy":
        per_token = w.get_logprobs(batch, 2)
        loss = ClippedPGLoss(LossConfig(kl_coef=0.0))
    else:
        per_token = w.get_values(batch, 2)
        loss = ClippedValueLoss(ValueLossConfig(cliprange=0.05, coef=1.0))
    m = w.train(batch, loss, len(CP_LENGTHS), 2)
    return {"per_token": per_token, "loss": m["loss"], "grad_norm": m["grad_norm"],
            "padding_fraction": m["padding_fraction"],
            "weights": {n: p.detach().clone() for n, p in w.model[0].named_parameters()}}


def _cp_checks() -> dict:
    """On 2 gloo processes: padded and packed at CP=1 (DP=2, each rank half the rows), then
    packed at CP=2 (DP=1, every row), for the policy and the critic."""
    from mcore_rl.data import batch as B

    batch = _cp_rows()
    rank = torch.distributed.get_rank()
    out = {}
    for kind in ("policy", "value"):
        use_layout()
        shard = B.shard(batch, 2)[rank]
        out[f"{kind}_padded_cp1"] = _cp_step(kind, False, shard)
        out[f"{kind}_packed_cp1"] = _cp_step(kind, True, shard)
        use_layout(context_parallel_size=2)
        out[f"{kind}_packed_cp2"] = _cp_step(kind, True, batch, **CP_TORCH)
    return out


def _every_check() -> dict:
    """The model, worker and context-parallel checks, one after the other on the same 2
    processes (each switches to its layouts with use_layout and seeds its own data)."""
    return {"model": _all_checks(), "workers": _all_worker_checks(), "cp": _cp_checks()}


@pytest.fixture(scope="module")
def spawned():
    """One spawn of 2 gloo processes for every distributed check of the module."""
    return run_distributed(_every_check, 2)


@pytest.fixture(scope="module")
def cp_results(spawned):
    return [r["cp"] for r in spawned]


@pytest.mark.parametrize("kind", ["policy", "value"])
@pytest.mark.parametrize("reference", ["padded_cp1", "packed_cp1"])
def test_packed_context_parallel_matches_cp1(cp_results, kind, reference):
    """Packed micro-batches at CP = 2 (every sequence padded to a multiple of 4 and split into
    4 chunks, rank r holding chunks r and 3 - r of each; keys and values all-gathered,
    attention within each sequence; the logprobs / values gathered back to packed order)
    against CP = 1, padded and packed, on the same weights and rows of uneven lengths: per-token
    logprobs (values), loss, grad norm and the weights after one SGD step agree to fp32
    round-off (bounds: 1e-5 relative, weights 1e-6 absolute; measured ~1e-7)."""
    from mcore_rl.controller.parity import relative_diff

    batch = _cp_rows()
    ranks = [r[f"{kind}_{reference}"] for r in cp_results]
    ref_tokens = torch.cat([r["per_token"] for r in ranks])  # the DP shards, in row order
    for r in cp_results:
        got = r[f"{kind}_packed_cp2"]
        assert got["per_token"].shape == ref_tokens.shape == batch["input_ids"].shape
        assert relative_diff(got["per_token"], ref_tokens) < 1e-5
        assert relative_diff(got["loss"], ranks[0]["loss"]) < 1e-5
        assert relative_diff(got["grad_norm"], ranks[0]["grad_norm"]) < 1e-5
        assert ranks[0]["grad_norm"] > 1e-3 and abs(ranks[0]["loss"]) > 1e-4
        assert max((got["weights"][n] - w).abs().max().item()
                   for n, w in ranks[0]["weights"].items()) < 1e-6
        valid = torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None]
        assert bool((got["per_token"][valid & (torch.arange(valid.shape[1]) > 0)] != 0).all())
        assert got["padding_fraction"] > 0  # the per-sequence padding to 2 CP is counted


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("spec,moved", [("transformer_engine", True), ("torch", False),
                                        ("local", False)])
def test_packed_params_put_cu_seqlens_on_the_device_for_transformer_engine(spec, moved, cp):
    """TE's fused attention reads ``cu_seqlens`` on the device (a host copy failed on an H100 in
    ``fused_attn_fwd``): on the ``transformer_engine`` spec the worker's ``PackedSeqParams``
    carry it on the worker's device as int32; the other specs keep the host copy (they move
    it once themselves, without a sync). The worker's device is ``meta`` here, so the move is
    visible on the CPU machine. With CP > 1 on the TE spec the padded fields that TE's CP
    attention reads (``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded``) are set, and are the
    very object of ``cu_seqlens_q`` / ``cu_seqlens_kv`` (TE then keeps ``pad_between_seqs``
    off: the padding to ``2 CP`` counts as tokens of its sequence); elsewhere they stay None."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_rl.data.packing import CU_SEQLENS, MAX_SEQLEN
    from mcore_rl.workers.megatron_worker import MegatronTrainWorker

    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    worker = SimpleNamespace(megatron_cfg=SimpleNamespace(layer_spec=spec, context_parallel_size=cp),
                             device=torch.device("meta"))
    params = MegatronTrainWorker._packed_params(worker, {CU_SEQLENS: cu,
                                                         MAX_SEQLEN: torch.tensor(4)})
    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    assert params.max_seqlen_q == params.max_seqlen_kv == 4
    assert params.cu_seqlens_q is params.cu_seqlens_kv
    for t in (params.cu_seqlens_q, params.cu_seqlens_kv):
        assert t.dtype == torch.int32 and t.shape == cu.shape
        assert t.device == (torch.device("meta") if moved else cu.device)
        if not moved:
            assert torch.equal(t, cu)
    if spec == "transformer_engine" and cp > 1:
        assert params.cu_seqlens_q_padded is params.cu_seqlens_q
        assert params.cu_seqlens_kv_padded is params.cu_seqlens_q
    else:
        assert params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None
