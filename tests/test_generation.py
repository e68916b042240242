"""The hf generation backend against a reference transformers model run another way
(full forward passes without KV cache, one unpadded row at a time), and the shared sampling
(inversion against directly computed probabilities, per-row random streams)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from mcore_rl.config.schema import DataConfig, GenerationConfig, TrainConfig
from mcore_rl.distributed.worker_group import typed
from mcore_rl.generation.base import BackendContext, assemble_rollout
from mcore_rl.generation.hf import HFGenerationBackend
from mcore_rl.generation.registry import backend_class, backend_names, build_backend
from mcore_rl.generation.sampling import (Sampler, block_inverse, last_with_mass, row_uniforms,
                                          scan_inverse)

VOCAB = 50
PAD = 0
# Different lengths in one chunk exercise left padding; 5 prompts with batch_size 3 two chunks.
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16], [20], [3, 4, 30, 31, 32, 33], [44, 45]]


def _hf_config(tied: bool) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def _reference(tied: bool = False) -> Qwen2ForCausalLM:
    """Seeded random weights, larger than HF's init so the next-token distributions are peaked."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_hf_config(tied)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def reference() -> Qwen2ForCausalLM:
    return _reference()


def _backend(reference, eos=VOCAB - 1, max_total_length=24, refit=True, **gen) -> HFGenerationBackend:
    cfg = GenerationConfig(**{"max_new_tokens": 10, "batch_size": 3, **gen})
    backend = HFGenerationBackend(reference.config, cfg, eos_token_id=eos, pad_token_id=PAD,
                                  max_total_length=max_total_length)
    if refit:
        backend.update_weights(reference.state_dict().items())
    return backend


@torch.no_grad()
def _reference_greedy(model, prompt, eos, budget):
    """Argmax decoding with a full forward over the whole prefix each step (no KV cache)."""
    seq = list(prompt)
    for _ in range(budget):
        token = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(token)
        if token == eos:
            break
    return seq


@torch.no_grad()
def _reference_logprobs(model, batch, temperature):
    """log_softmax(logits / T) of a full forward over each final sequence, at the response
    positions, in the [B, S] layout of ``generation_logprobs``."""
    out = torch.zeros_like(batch["generation_logprobs"])
    for i in range(batch["input_ids"].shape[0]):
        n, p = int(batch["input_lengths"][i]), int(batch["prompt_lengths"][i])
        ids = batch["input_ids"][i, :n]
        logp = torch.log_softmax(model(ids[None]).logits[0].float() / temperature, -1)
        out[i, p:n] = logp[p - 1:n - 1].gather(-1, ids[p:n, None]).squeeze(-1)
    return out


def _check_layout(batch, prompts, eos, budgets):
    """Right padding, masks and lengths consistent with the prompts, eos and budgets."""
    for i, prompt in enumerate(prompts):
        p, n = len(prompt), int(batch["input_lengths"][i])
        r = int(batch["response_lengths"][i])
        assert int(batch["prompt_lengths"][i]) == p and n == p + r and 1 <= r <= budgets[i]
        assert batch["input_ids"][i, :p].tolist() == prompt
        assert (batch["input_ids"][i, n:] == PAD).all()
        assert batch["token_mask"][i].tolist() == [0.0] * p + [1.0] * r + [0.0] * (batch["input_ids"].shape[1] - n)
        assert (batch["generation_logprobs"][i][batch["token_mask"][i] == 0] == 0).all()
        response = batch["input_ids"][i, p:n].tolist()
        assert eos not in response[:-1]
        if response[-1] == eos:
            assert batch["truncated"][i] == 0
        else:
            assert batch["truncated"][i] == 1 and r == budgets[i]
    assert batch["input_ids"].shape[1] == int(batch["input_lengths"].max())


def test_greedy_matches_full_forward_argmax_and_eos_stops(reference):
    # Pick as eos a token the unconstrained greedy decode emits mid-response in row 0,
    # so at least one row stops at eos and others (likely) run to the budget.
    free = _reference_greedy(reference, PROMPTS[0], eos=-1, budget=10)
    eos = free[len(PROMPTS[0]) + 2]
    backend = _backend(reference, eos=eos)
    batch = backend.generate(PROMPTS, seed=0, greedy=True)
    budgets = [10] * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        expected = _reference_greedy(reference, prompt, eos, budget=10)
        assert batch["input_ids"][i, : int(batch["input_lengths"][i])].tolist() == expected
    assert batch["truncated"][0] == 0 and batch["input_ids"][0, int(batch["input_lengths"][0]) - 1] == eos
    _check_layout(batch, PROMPTS, eos, budgets)
    expected_lp = _reference_logprobs(reference, batch, temperature=1.0)
    assert (batch["generation_logprobs"] - expected_lp).abs().max() < 1e-5


def test_sampled_logprobs_match_full_forward_and_seed_reproduces(reference):
    backend = _backend(reference, temperature=0.7)
    batch = backend.generate(PROMPTS, seed=1)
    _check_layout(batch, PROMPTS, VOCAB - 1, [10] * len(PROMPTS))
    expected = _reference_logprobs(reference, batch, temperature=0.7)
    assert (batch["generation_logprobs"] - expected).abs().max() < 1e-5
    again = backend.generate(PROMPTS, seed=1)
    for key in batch:
        assert torch.equal(batch[key], again[key]), key
    other = backend.generate(PROMPTS, seed=2)
    assert other["input_ids"].shape != batch["input_ids"].shape or not torch.equal(other["input_ids"], batch["input_ids"])


def test_tiny_top_p_gives_greedy_tokens_with_unfiltered_logprobs(reference):
    greedy = _backend(reference).generate(PROMPTS, seed=0, greedy=True)
    nucleus = _backend(reference, top_p=1e-3).generate(PROMPTS, seed=3)
    assert torch.equal(greedy["input_ids"], nucleus["input_ids"])
    # temperature 1 and logprobs taken before the top-p filter: equal to greedy's.
    assert (greedy["generation_logprobs"] - nucleus["generation_logprobs"]).abs().max() < 1e-6


def test_length_limits(reference):
    max_total = 12
    backend = _backend(reference, max_new_tokens=5, max_total_length=max_total)
    batch = backend.generate(PROMPTS, seed=4)
    budgets = [min(5, max_total - len(p)) for p in PROMPTS]
    _check_layout(batch, PROMPTS, VOCAB - 1, budgets)
    assert int(batch["input_lengths"].max()) <= max_total
    # The 8-token prompt has a budget of 4: the total cap binds, not max_new_tokens.
    assert int(batch["response_lengths"][1]) <= 4
    with pytest.raises(ValueError, match="prompt 1 .*max_total_length"):
        _backend(reference, max_total_length=8).generate(PROMPTS, seed=0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        backend.generate([[]], seed=0)


def test_refit_errors_and_bytes(reference):
    backend = _backend(reference, refit=False)
    with pytest.raises(RuntimeError, match="no weights were loaded"):
        backend.generate(PROMPTS, seed=0)
    state = reference.state_dict()
    with pytest.raises(ValueError, match="unknown names \\['decoder.bogus'\\]"):
        backend.update_weights(list(state.items()) + [("decoder.bogus", torch.zeros(1))])
    partial = [(k, v) for k, v in state.items() if k != "model.norm.weight"]
    with pytest.raises(ValueError, match="left unwritten \\['model.norm.weight'\\]"):
        backend.update_weights(partial)
    with pytest.raises(ValueError, match="lm_head.weight.*shape"):
        backend.update_weights([("lm_head.weight", torch.zeros(3, 3))])
    with pytest.raises(RuntimeError, match="no weights were loaded"):
        backend.generate(PROMPTS, seed=0)  # a failed refit leaves the backend unusable
    backend.update_weights(state.items())
    assert backend.last_refit_bytes == sum(v.numel() * 4 for v in state.values())
    assert backend.last_refit_seconds > 0


def test_tied_embeddings_refit_without_lm_head():
    tied = _reference(tied=True)
    backend = _backend(tied, refit=False)
    backend.update_weights((k, v) for k, v in tied.state_dict().items() if k != "lm_head.weight")
    batch = backend.generate(PROMPTS, seed=0, greedy=True)
    for i, prompt in enumerate(PROMPTS):
        expected = _reference_greedy(tied, prompt, VOCAB - 1, budget=10)
        assert batch["input_ids"][i, : int(batch["input_lengths"][i])].tolist() == expected


def test_config_errors(reference):
    with pytest.raises(ValueError, match="generation.temperature"):
        _backend(reference, refit=False, temperature=0.0)
    with pytest.raises(ValueError, match="generation.top_p"):
        _backend(reference, refit=False, top_p=1.5)


def test_registry_builds_from_the_context_and_refit_pulls_hf_weights(reference):
    assert {"hf", "megatron"} <= set(backend_names())
    with pytest.raises(ValueError, match="generation.backend: unknown backend 'vllm-typo'"):
        backend_class("vllm-typo")
    assert backend_class("hf") is HFGenerationBackend and backend_class("hf").worker_groups(TrainConfig()) == {}
    cfg = TrainConfig(generation=GenerationConfig(batch_size=2, max_new_tokens=10),
                      data=DataConfig(max_total_length=16))
    backend = build_backend(BackendContext(
        cfg=cfg, hf_config=reference.config, eos_token_id=VOCAB - 1, pad_token_id=PAD,
        vocab_size=VOCAB, device="cpu", policy=None, placement=None))
    assert isinstance(backend, HFGenerationBackend) and not backend.shares_policy_weights
    assert (backend.cfg.batch_size, backend.max_total_length) == (2, 16)
    # the hf channel: rank 0's Hugging Face-named tensors, gathered by the policy
    calls = []
    state = reference.state_dict()
    policy = SimpleNamespace(call=typed(lambda method: calls.append(method) or [state, None]))
    stats = backend.refit(policy)
    assert calls == ["get_hf_weights"]
    assert stats == {"refit/gbytes": sum(v.numel() * 4 for v in state.values()) / 1e9}
    expected = _backend(reference, max_total_length=16).generate(PROMPTS, seed=3)
    got = backend.generate(PROMPTS, seed=3)
    for key in expected:  # chunks of 2 rows, not 3: logprobs round differently
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6, msg=key)


def test_generate_async_hands_out_groups_as_chunks_finish(reference):
    prompts = PROMPTS + [[7, 7]]  # 6 rows: chunks of 3 (batch_size), groups of 2
    backend = _backend(reference, temperature=0.7)
    whole = backend.generate(prompts, seed=4)
    stream = backend.generate_async(prompts, seed=4, group_size=2)
    groups = list(stream)
    # group 0 completes in chunk 0 (rows 0-2); groups 1 and 2 in chunk 1
    assert [g.rows for g in groups] == [range(0, 2), range(2, 4), range(4, 6)]
    for g in groups:
        part = assemble_rollout([prompts[i] for i in g.rows], g.responses, PAD)
        for j, row in enumerate(g.rows):
            n = int(whole["input_lengths"][row])
            assert int(part["input_lengths"][j]) == n
            for key in ("input_ids", "token_mask", "generation_logprobs"):
                assert torch.equal(part[key][j, :n], whole[key][row, :n]), key
    with pytest.raises(ValueError, match="6 prompts do not split into groups of group_size=4"):
        backend.generate_async(prompts, seed=4, group_size=4)
    with pytest.raises(ValueError, match="prompt 0 is empty"):  # checked at the call, not later
        backend.generate_async([[]], seed=0)


def test_rollouts_do_not_depend_on_batch_size(reference):
    one_chunk = _backend(reference, temperature=0.7, batch_size=len(PROMPTS)).generate(PROMPTS, seed=5)
    chunks_of_two = _backend(reference, temperature=0.7, batch_size=2).generate(PROMPTS, seed=5)
    for key in one_chunk:
        torch.testing.assert_close(chunks_of_two[key], one_chunk[key], rtol=0, atol=1e-6, msg=key)


def test_row_uniforms_are_per_row_streams():
    base = row_uniforms(3, [0, 1, 2, 7], 6)
    assert base.shape == (4, 6) and base.dtype == torch.float32
    assert ((base >= 0) & (base < 1)).all()
    assert torch.equal(row_uniforms(3, [7], 6)[0], base[3])  # whatever other rows are drawn
    assert torch.equal(row_uniforms(3, [1], 2)[0], base[1, :2])  # a prefix of a longer stream
    assert not torch.equal(row_uniforms(4, [1], 6)[0], base[1])
    assert len({tuple(r.tolist()) for r in base}) == 4
    with pytest.raises(ValueError, match="row index -1"):
        row_uniforms(3, [-1], 2)


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_sampler_draws_by_inversion_with_unfiltered_logprobs(top_p, blocks):
    """N evenly spaced uniforms draw each token about N x its probability (temperature-scaled,
    renormalized over the nucleus), so the inversion is checked against softmax computed
    directly; logprobs are always those before the top-p filter."""
    logits = torch.tensor([2.0, -1.0, 0.5, 1.5, -3.0, 0.0])
    temperature, n = 0.8, 4000
    sampler = Sampler(GenerationConfig(temperature=temperature, top_p=top_p,
                                       block_sampling=blocks))
    uniforms = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    tokens, logprobs = sampler(logits.expand(n, -1), uniforms)
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    # the smallest set of most likely tokens whose mass reaches top_p
    keep = order[: int((probs[order].cumsum(0) < top_p - 1e-12).sum()) + 1]
    expected = torch.zeros_like(probs)
    expected[keep] = probs[keep] / probs[keep].sum()
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    assert (counts - n * expected).abs().max() <= 1
    torch.testing.assert_close(logprobs, torch.log(probs.float())[tokens])
    greedy, greedy_lp = sampler(logits[None], None)
    assert int(greedy) == 0 and greedy_lp.item() == pytest.approx(float(torch.log_softmax(logits, -1)[0]))
    with pytest.raises(ValueError, match="generation.temperature"):
        Sampler(GenerationConfig(temperature=0.0))



def _reference_sample(logits, uniforms, temperature, top_p):
    """The sampler as first written (a pass for the division by the temperature, an int cumsum
    for the last token with mass): the reference :class:`Sampler` must match token for token."""
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if top_p < 1:
        from transformers import TopPLogitsWarper

        scaled = TopPLogitsWarper(top_p)(None, scaled)
    probs = torch.softmax(scaled, dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.float() * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    tokens = torch.minimum(tokens, (probs > 0).to(torch.int32).cumsum(dim=-1).argmax(dim=-1))
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampler_draws_the_reference_tokens(temperature, top_p):
    """Random logits (fp32; bf16-cast, with ties; rows spread wide enough that tokens underflow
    to probability 0; -inf tails and heads) and uniforms from 0 to the largest float32 below 1:
    the same tokens and logprobs, bit for bit, as the reference."""
    g = torch.Generator().manual_seed(11)
    n, vocab = 512, 300
    scale = torch.tensor([1.0, 4.0, 60.0, 200.0]).repeat(n // 4)[:, None]
    logits = torch.randn(n, vocab, generator=g) * scale
    logits[::3, -7:] = float("-inf")
    logits[1::5, :5] = float("-inf")
    uniforms = torch.rand(n, generator=g)
    uniforms[::2] = 1 - 2.0 ** -24
    uniforms[1::8] = 0.0
    sampler = Sampler(GenerationConfig(temperature=temperature, top_p=top_p))
    for x in (logits, logits.bfloat16()):
        tokens, logprobs = sampler(x, uniforms)
        expected, expected_lp = _reference_sample(x, uniforms, temperature, top_p)
        assert torch.equal(tokens, expected) and torch.equal(logprobs, expected_lp)
    assert ((logits.softmax(-1) == 0).sum(-1) > 0).float().mean() > 0.4  # zero-mass tokens


@pytest.mark.parametrize("vocab,block", [(300, 256), (1000, 64), (97, 7), (49, 256)])
def test_block_inversion_differs_from_the_scan_only_at_rounding_boundaries(vocab, block):
    """generation.block_sampling: the two-level inversion against the whole-vocabulary scan
    (:func:`scan_inverse`, the sampler before it) on 20,000 rows (logit spreads from flat to
    peaked enough that tokens underflow to 0, -inf heads and tails, uniforms from 0 to the
    largest float32 below 1; blocks that divide the vocabulary and a short last block): every
    token has mass, and a token differs only where the target lies within 1e-6 of the scan's
    cdf boundary between the two tokens (float32 rounding of the sums; measured <= 1.2e-7,
    and only for uniforms at the ends of [0, 1): targets within rounding of the total).
    Through :class:`Sampler` (which takes the probabilities as exp of the logprobs there) the
    logprobs of equal tokens are the scan's bit for bit."""
    g = torch.Generator().manual_seed(vocab)
    n = 20000
    scale = torch.tensor([0.1, 1.0, 4.0, 30.0, 200.0]).repeat(n // 5)[:, None]
    logits = torch.randn(n, vocab, generator=g) * scale
    logits[::3, -5:] = float("-inf")
    logits[1::7, :4] = float("-inf")
    uniforms = torch.rand(n, generator=g)
    ends = torch.zeros(n, dtype=torch.bool)
    ends[::11] = ends[1::13] = True
    uniforms[::11] = 1 - 2.0 ** -24  # targets within rounding of the total: differ most
    uniforms[1::13] = 0.0
    probs = torch.softmax(logits, -1)
    scan, got = scan_inverse(probs, uniforms), block_inverse(probs, uniforms, block)
    assert (probs.gather(1, got[:, None]) > 0).all()
    differ = (scan != got).nonzero().squeeze(-1)
    assert int((~ends[differ]).sum()) <= n // 5000  # random uniforms: 0 measured
    cdf = probs.cumsum(-1)
    target = uniforms * cdf[:, -1]
    low = torch.minimum(scan, got)[differ]
    gap = (cdf[differ, low] - target[differ]).abs()
    assert gap.numel() == 0 or float(gap.max()) < 1e-6, gap.max()
    base = Sampler(GenerationConfig(temperature=0.7))
    fast = Sampler(GenerationConfig(temperature=0.7, block_sampling=True))
    (t0, lp0), (t1, lp1) = base(logits, uniforms), fast(logits, uniforms)
    same = t0 == t1
    assert int((~same & ~ends).sum()) <= n // 5000 and torch.equal(lp0[same], lp1[same])


def test_last_with_mass_is_the_int_cumsum_argmax():
    """The scan-free index of the last token with mass against the int cumsum + argmax it
    replaced: random zero patterns, zero tails, a row with one token, a row with none."""
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(64, 97, generator=g) * (torch.rand(64, 97, generator=g) < 0.3)
    probs[::4, -20:] = 0
    probs[1] = 0
    probs[1, 0] = 0.5
    probs[2] = 0
    expected = (probs > 0).to(torch.int32).cumsum(dim=-1).argmax(dim=-1)
    got = last_with_mass(probs)
    assert torch.equal(got.long(), expected) and got[1] == 0 and got[2] == 0
    assert got[0] == int((probs[0] > 0).nonzero().max())
